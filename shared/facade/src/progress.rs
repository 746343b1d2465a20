//! What the facade remembers about one assignment's reports, and the pure decisions made from it:
//! which calls are still admissible after the task became terminal, and which facts to publish
//! after the forge answered.

use jr_forge::proto::runner::v1::Result as ForgeResult;
use jr_protocol::TaskResult;

/// Report progress of one assignment attempt. Lives in memory; after a restart it starts empty and
/// the ledger's `terminal` flag is the only thing known.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub attempt: u32,
    /// This facade won the claim (the ledger's view may lag behind).
    pub claimed_here: bool,
    /// Highest `ack_index` the forge returned for UpdateLog.
    pub acked: Option<i64>,
    /// The forge acknowledged `UpdateLog(no_more)` with every row.
    pub log_closed: bool,
    /// The result the executor sent in its accepted final UpdateTask.
    pub final_request: Option<i32>,
    /// A `terminal` fact exists (published here or found in the ledger).
    pub terminal: bool,
    /// The "executor finished reporting" signal was conveyed: by `terminal.log_closed` or by an
    /// `executor-finished` fact.
    pub finish_reported: bool,
    /// The executor has had a report forwarded (it evidently holds its task).
    pub reported: bool,
    /// The final UpdateTask the forge accepted (the result asked for, and the forge's reply),
    /// kept from the moment the forge answered, before its `terminal` is recorded: a retry of it
    /// is answered from here and never forwarded again.
    pub accepted_final: Option<(i32, jr_forge::proto::runner::v1::UpdateTaskResponse)>,
}

/// Whether a call reaches the forge.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    Forward,
    Refuse(&'static str),
}

/// What to do with a final UpdateTask before the forge is asked.
#[derive(Debug, PartialEq)]
pub(crate) enum FinalAnswer {
    /// Not a final, or no final decided yet: decide as usual.
    Undecided,
    /// The forge accepted this same final here: answer with its reply (and record the
    /// terminal if that is still missing).
    Accepted(jr_forge::proto::runner::v1::UpdateTaskResponse),
    /// The final is recorded in the ledger but not here (another replica, or before a
    /// restart): answer from the ledger's terminal.
    FromLedger,
    Refuse(&'static str),
}

/// What to publish after the forge accepted a call.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FollowUp {
    Nothing,
    Terminal {
        result: TaskResult,
        log_closed: bool,
    },
    ExecutorFinished,
}

impl Progress {
    /// Final and its end reported: nothing about the task can change any more.
    pub fn is_done(&self) -> bool {
        self.terminal && self.finish_reported
    }

    /// Aligns the record with the ledger's view: a new attempt starts afresh.
    pub fn sync(&mut self, attempt: u32, ledger_terminal: bool) {
        if self.attempt != attempt {
            *self = Progress {
                attempt,
                ..Progress::default()
            };
        }
        self.terminal |= ledger_terminal;
    }

    /// A final UpdateTask whose task already has a final result is answered without the forge:
    /// a retried final (its reply lost, or the terminal not yet recorded) must reach the forge
    /// once only. Another final result than the accepted one is refused, as any call after the
    /// end that is not an idempotent re-send.
    pub fn final_answer(&self, requested: i32) -> FinalAnswer {
        if requested == ForgeResult::Unspecified as i32 {
            return FinalAnswer::Undecided;
        }
        if let Some((previous, reply)) = &self.accepted_final {
            return if *previous == requested {
                FinalAnswer::Accepted(reply.clone())
            } else {
                FinalAnswer::Refuse("task is already final with another result")
            };
        }
        if self.terminal {
            return FinalAnswer::FromLedger;
        }
        FinalAnswer::Undecided
    }

    /// After terminal a heartbeat is admissible (the forge changes nothing on a final task and
    /// answers with its final result, which is what stops a runner still going), and so is a
    /// re-send of the same final result; another final result is not.
    pub fn admit_update_task(&self, requested: i32) -> Admission {
        if !self.terminal || requested == ForgeResult::Unspecified as i32 {
            return Admission::Forward;
        }
        match self.final_request {
            Some(previous) if previous != requested => {
                Admission::Refuse("task is already final with another result")
            }
            // Same result, or unknown after a restart: the forge keeps its final state anyway.
            Some(_) | None => Admission::Forward,
        }
    }

    /// After terminal the log may still be completed and closed (older runners send the result
    /// first); once closed, only re-sends inside the acknowledged range are admissible.
    pub fn admit_update_log(&self, index: i64, rows: usize) -> Admission {
        if !self.terminal || !self.log_closed {
            return Admission::Forward;
        }
        let end = index.saturating_add(i64::try_from(rows).unwrap_or(i64::MAX));
        match self.acked {
            Some(acked) if end <= acked => Admission::Forward,
            Some(_) | None => Admission::Refuse("task is final and its log is closed"),
        }
    }

    /// Records a forge-accepted UpdateTask; a final request with a final reply yields `terminal`.
    pub fn after_update_task(&mut self, requested: i32, replied: i32) -> FollowUp {
        if requested == ForgeResult::Unspecified as i32 || self.terminal {
            return FollowUp::Nothing;
        }
        match jr_forge::report::final_result(replied) {
            Some(result) => FollowUp::Terminal {
                result,
                log_closed: self.log_closed,
            },
            None => FollowUp::Nothing,
        }
    }

    /// Marks the terminal fact as existing (published by us or already there).
    pub fn terminal_recorded(&mut self, requested: i32, log_closed: bool) {
        self.terminal = true;
        self.final_request = Some(requested);
        self.finish_reported |= log_closed;
    }

    /// Records a forge-accepted UpdateLog; closing the log after terminal yields
    /// `executor-finished`.
    pub fn after_update_log(
        &mut self,
        index: i64,
        rows: usize,
        no_more: bool,
        ack: i64,
    ) -> FollowUp {
        self.acked = Some(self.acked.map_or(ack, |a| a.max(ack)));
        let end = index.saturating_add(i64::try_from(rows).unwrap_or(i64::MAX));
        if no_more && ack == end {
            self.log_closed = true;
        }
        if self.log_closed && self.terminal && !self.finish_reported {
            FollowUp::ExecutorFinished
        } else {
            FollowUp::Nothing
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNSPEC: i32 = ForgeResult::Unspecified as i32;
    const SUCCESS: i32 = ForgeResult::Success as i32;
    const FAILURE: i32 = ForgeResult::Failure as i32;
    const CANCELLED: i32 = ForgeResult::Cancelled as i32;

    #[test]
    fn log_closed_before_result_rides_on_terminal() {
        let mut p = Progress::default();
        p.sync(1, false);
        assert_eq!(p.after_update_log(0, 3, true, 3), FollowUp::Nothing);
        assert!(p.log_closed);
        assert_eq!(
            p.after_update_task(SUCCESS, SUCCESS),
            FollowUp::Terminal {
                result: TaskResult::Success,
                log_closed: true
            }
        );
        p.terminal_recorded(SUCCESS, true);
        assert_eq!(p.after_update_log(3, 0, true, 3), FollowUp::Nothing);
    }

    #[test]
    fn log_closed_after_result_yields_executor_finished_once() {
        let mut p = Progress::default();
        p.sync(1, false);
        assert_eq!(
            p.after_update_task(FAILURE, CANCELLED),
            FollowUp::Terminal {
                result: TaskResult::Cancelled,
                log_closed: false
            }
        );
        p.terminal_recorded(FAILURE, false);
        assert_eq!(p.admit_update_log(0, 5), Admission::Forward);
        assert_eq!(
            p.after_update_log(0, 5, true, 5),
            FollowUp::ExecutorFinished
        );
        p.finish_reported = true;
        assert_eq!(p.admit_update_log(2, 3), Admission::Forward);
        assert!(matches!(p.admit_update_log(5, 1), Admission::Refuse(_)));
    }

    #[test]
    fn short_ack_does_not_close_the_log() {
        let mut p = Progress::default();
        p.after_update_log(0, 4, true, 2);
        assert!(!p.log_closed);
    }

    #[test]
    fn after_terminal_only_the_same_final_result_or_a_heartbeat_is_admitted() {
        let mut p = Progress::default();
        p.terminal_recorded(SUCCESS, false);
        assert_eq!(p.admit_update_task(SUCCESS), Admission::Forward);
        assert!(matches!(p.admit_update_task(FAILURE), Admission::Refuse(_)));
        // A heartbeat learns the final result from the forge's answer.
        assert_eq!(p.admit_update_task(UNSPEC), Admission::Forward);
        assert_eq!(p.after_update_task(SUCCESS, SUCCESS), FollowUp::Nothing);
    }

    #[test]
    fn heartbeat_reply_with_cancelled_is_not_terminal() {
        let mut p = Progress::default();
        assert_eq!(p.after_update_task(UNSPEC, CANCELLED), FollowUp::Nothing);
    }

    #[test]
    fn new_attempt_starts_afresh() {
        let mut p = Progress::default();
        p.sync(1, false);
        p.claimed_here = true;
        p.sync(2, false);
        assert!(!p.claimed_here);
        assert_eq!(p.attempt, 2);
    }
}
