//! What a scale set listener decides for each queue message, as a pure function of the
//! message and what it already tracks: which offered jobs to acquire, which jobs to check
//! against the trust guard, and which runner starts and job completions become the once-only
//! `claimed` and `terminal` facts. The driver performs the actions in order and deletes the
//! message only after all of them succeeded, so a crash in between makes the service deliver
//! the message again, and every decision here is idempotent under that redelivery.
//!
//! Runners are not bound to jobs: the service hands any job assigned to the scale set to any
//! idle runner of it. So jetrunner makes runners by number, not per job: after every message
//! (and every empty poll) the driver compares GitHub's statistics with the runners it holds
//! ([`crate::scale`]) and makes or removes runners. Each runner is one jetrunner assignment,
//! named `jr-<assignment>-1`; `JobStarted` claims the assignment of the runner it names (with
//! the job that runner took), and `JobCompleted` ends that runner's assignment, so the
//! workload deleted after the terminal is the one that ran the job, as for a Gitea job.
//!
//! Jobs are keyed by [`JobFacts::key`] (their `runnerRequestId`, or their `jobId` where
//! github.com sends 0 for the former) and named in the ledger by [`JobFacts::task_id`].

use std::collections::{BTreeMap, BTreeSet};

use crate::scale::Demand;
use crate::wire::{JobFacts, JobMessage, QueueMessage, Statistics};

/// The JIT runner name of `assignment`'s `attempt`: `jr-<assignment>-<attempt>`.
pub fn runner_name(assignment: &str, attempt: u32) -> String {
    format!("jr-{assignment}-{attempt}")
}

/// The assignment and attempt a runner name stands for, if it is one of ours.
pub fn parse_runner_name(name: &str) -> Option<(String, u32)> {
    let rest = name.strip_prefix("jr-")?;
    let (assignment, attempt) = rest.rsplit_once('-')?;
    let attempt: u32 = attempt.parse().ok()?;
    (!assignment.is_empty() && attempt > 0).then(|| (assignment.to_owned(), attempt))
}

/// How a job ended, as jetrunner records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    Cancelled,
    /// A result this client does not know, kept as GitHub sent it.
    Other(String),
}

impl Outcome {
    pub fn from_result(result: &str) -> Outcome {
        match result.to_ascii_lowercase().as_str() {
            "succeeded" | "success" => Outcome::Succeeded,
            "failed" | "failure" => Outcome::Failed,
            "canceled" | "cancelled" => Outcome::Cancelled,
            _ => Outcome::Other(result.to_owned()),
        }
    }
}

/// One step for the driver, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Ask for these offered jobs (`runnerRequestId`s).
    Acquire(Vec<i64>),
    /// A job newly assigned to the scale set: the trust guard (if any) decides whether it may
    /// run here; a refused job's run is cancelled.
    Check(JobFacts),
    /// Runner `runner_name` (the runner of `assignment`) took `job`: the once-only claim of the
    /// runner's assignment.
    Claim {
        job: JobFacts,
        assignment: String,
        runner_name: String,
        runner_id: i64,
    },
    /// `job` is over on the runner of `assignment`: the once-only terminal of the runner's
    /// assignment.
    Finish {
        job: JobFacts,
        assignment: String,
        outcome: Outcome,
    },
    /// Delete the message: everything above is done.
    Delete(i64),
}

/// A runner the listener holds: one published (or being published) assignment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldRunner {
    /// Made in this order (oldest first).
    pub seq: u64,
    /// GitHub said it took a job (`JobStarted`), or refused to remove it because it has one.
    pub busy: bool,
}

/// The listener's memory: the jobs assigned to the scale set it has seen, the runners it holds
/// (rebuilt from the ledger after a restart), the jobs it asked for that are not assigned yet,
/// and GitHub's latest statistics.
#[derive(Clone, Debug, Default)]
pub struct ListenerState {
    /// Jobs assigned to the scale set and not over, by [`JobFacts::key`]: `true` once started.
    jobs: BTreeMap<String, bool>,
    acquired: BTreeSet<i64>,
    /// Offered jobs there was no room for, oldest first: asked for when room frees up (whether
    /// the service offers them again is not documented; a job taken elsewhere is simply not
    /// granted).
    offered: BTreeSet<i64>,
    /// Jobs the trust guard refused whose completion has not come yet: they get no runner.
    refused: BTreeSet<String>,
    runners: BTreeMap<String, HeldRunner>,
    next_seq: u64,
    /// Runners whose publish failed: published after all, or to be removed from GitHub.
    unsettled: BTreeSet<String>,
    /// Runners removed from GitHub whose withdrawal is not recorded yet.
    removed: BTreeSet<String>,
    /// `None` until GitHub said (the session, or a message): nothing is removed meanwhile.
    statistics: Option<Statistics>,
}

impl ListenerState {
    /// A listener that holds `runners` (assignment, busy), from the ledger.
    pub fn new(runners: impl IntoIterator<Item = (String, bool)>) -> ListenerState {
        let mut state = ListenerState::default();
        for (assignment, busy) in runners {
            state.runner_held(&assignment, busy);
        }
        state
    }

    fn runner_held(&mut self, assignment: &str, busy: bool) {
        self.next_seq += 1;
        let seq = self.next_seq;
        self.runners
            .entry(assignment.to_owned())
            .and_modify(|r| r.busy |= busy)
            .or_insert(HeldRunner { seq, busy });
    }

    /// A runner was made for `assignment` (its assignment published).
    pub fn runner_made(&mut self, assignment: &str) {
        self.runner_held(assignment, false);
    }

    /// The assignment of a runner made at GitHub could not be published (or its answer was
    /// lost): settled before the next runners are made.
    pub fn runner_unsettled(&mut self, assignment: &str) {
        self.unsettled.insert(assignment.to_owned());
    }

    /// Runners whose publish failed, to settle.
    pub fn take_unsettled(&mut self) -> Vec<String> {
        std::mem::take(&mut self.unsettled).into_iter().collect()
    }

    /// GitHub holds the runner of `assignment` busy.
    pub fn runner_busy(&mut self, assignment: &str) {
        self.runner_held(assignment, true);
    }

    /// The runner of `assignment` is gone: removed, lost, or over after its job.
    pub fn runner_gone(&mut self, assignment: &str) {
        self.runners.remove(assignment);
        self.removed.remove(assignment);
    }

    /// The runner of `assignment` was removed from GitHub; its withdrawal is recorded next.
    pub fn runner_removed(&mut self, assignment: &str) {
        self.removed.insert(assignment.to_owned());
    }

    /// Whether the runner of `assignment` was removed from GitHub by this listener.
    pub fn was_removed(&self, assignment: &str) -> bool {
        self.removed.contains(assignment)
    }

    /// Runners not known to be busy (starting, or idle), oldest first.
    pub fn free_runners(&self) -> Vec<String> {
        let mut free: Vec<(&u64, &String)> = self
            .runners
            .iter()
            .filter(|(_, r)| !r.busy)
            .map(|(a, r)| (&r.seq, a))
            .collect();
        free.sort();
        free.into_iter().map(|(_, a)| a.clone()).collect()
    }

    pub fn busy_runners(&self) -> usize {
        self.runners.values().filter(|r| r.busy).count()
    }

    /// Jobs assigned to the scale set and not over, as this listener saw them.
    pub fn jobs_held(&self) -> usize {
        self.jobs.len()
    }

    /// Jobs acquired and not yet assigned: they will take slots soon.
    pub fn acquired(&self) -> usize {
        self.acquired.len()
    }

    /// GitHub's latest statistics (zero before it said any).
    pub fn statistics(&self) -> Statistics {
        self.statistics.clone().unwrap_or_default()
    }

    /// GitHub's statistics from elsewhere than a message (the session's own).
    pub fn set_statistics(&mut self, statistics: &Statistics) {
        self.statistics = Some(statistics.clone());
    }

    /// What GitHub asks for: its latest statistics, less the jobs the guard refused. Before
    /// GitHub said anything, no job waits and the scale set does not count as idle.
    pub fn demand(&self) -> Demand {
        match &self.statistics {
            Some(statistics) => Demand::from_statistics(statistics, self.refused.len()),
            None => Demand {
                waiting: 0,
                idle: false,
                others_waiting: 0,
            },
        }
    }

    /// The trust guard refused `job`: it gets no runner.
    pub fn job_refused(&mut self, job: &JobFacts) {
        if self.jobs.contains_key(&job.key()) {
            self.refused.insert(job.key());
        }
    }

    /// The actions for `message`. `room` is how many more jobs the backends can start soon
    /// (free slots less what is queued for them); acquired-but-unassigned jobs count against it.
    pub fn on_message(&mut self, message: &QueueMessage, room: usize) -> Vec<Action> {
        self.statistics = Some(message.statistics.clone());
        let mut actions = Vec::new();
        let mut acquire = Vec::new();
        let mut room = room.saturating_sub(self.acquired.len());
        for job in &message.jobs {
            match job {
                JobMessage::Available(facts) => {
                    let id = facts.runner_request_id;
                    // Acquiring names jobs by their request id; without one there is nothing
                    // to ask for.
                    if id == 0 {
                        tracing::warn!(job = %facts.job_id, "offered job without a runnerRequestId; not acquired");
                        continue;
                    }
                    let held = self.jobs.contains_key(&facts.key())
                        || self.acquired.contains(&id)
                        || acquire.contains(&id);
                    if !held && room > 0 {
                        room -= 1;
                        acquire.push(id);
                    } else if !held {
                        self.offered.insert(id);
                    }
                }
                JobMessage::Assigned(facts) => {
                    let id = facts.runner_request_id;
                    self.acquired.remove(&id);
                    self.offered.remove(&id);
                    // A job already held is a re-sent message, not a second assignment.
                    if let std::collections::btree_map::Entry::Vacant(entry) =
                        self.jobs.entry(facts.key())
                    {
                        entry.insert(false);
                        actions.push(Action::Check(facts.clone()));
                    }
                }
                JobMessage::Started {
                    job,
                    runner_id,
                    runner_name,
                } => {
                    if let Some(started) = self.jobs.get_mut(&job.key()) {
                        *started = true;
                    }
                    match parse_runner_name(runner_name) {
                        Some((assignment, _)) => {
                            self.runner_busy(&assignment);
                            actions.push(Action::Claim {
                                job: job.clone(),
                                assignment,
                                runner_name: runner_name.clone(),
                                runner_id: *runner_id,
                            });
                        }
                        None => {
                            tracing::warn!(%runner_name, job = %job.key(), "a job of this scale set started on a runner jetrunner did not make");
                        }
                    }
                }
                JobMessage::Completed {
                    job,
                    result,
                    runner_name,
                    ..
                } => {
                    let id = job.runner_request_id;
                    self.jobs.remove(&job.key());
                    self.refused.remove(&job.key());
                    self.acquired.remove(&id);
                    self.offered.remove(&id);
                    // A job that never ran (cancelled while queued, or its assignment lapsed)
                    // or ran on a runner jetrunner did not make is nothing of ours: the
                    // runner count follows the statistics.
                    if let Some((assignment, _)) = parse_runner_name(runner_name) {
                        self.runner_gone(&assignment);
                        actions.push(Action::Finish {
                            job: job.clone(),
                            assignment,
                            outcome: Outcome::from_result(result),
                        });
                    }
                }
                JobMessage::Other { message_type } => {
                    tracing::debug!(%message_type, "job message of an unknown type ignored");
                }
            }
        }
        if !acquire.is_empty() {
            self.acquired.extend(acquire.iter().copied());
            actions.insert(0, Action::Acquire(acquire));
        }
        actions.push(Action::Delete(message.id));
        actions
    }

    /// After an acquire call: ids not granted are no longer expected (nor offered).
    pub fn acquire_answered(&mut self, asked: &[i64], granted: &[i64]) {
        for id in asked {
            if !granted.contains(id) {
                self.acquired.remove(id);
                self.offered.remove(id);
            }
        }
    }

    /// Offered jobs to ask for now that there is `room` (less what is acquired already).
    pub fn on_room(&mut self, room: usize) -> Option<Action> {
        let room = room.saturating_sub(self.acquired.len());
        let ids: Vec<i64> = self.offered.iter().copied().take(room).collect();
        if ids.is_empty() {
            return None;
        }
        for id in &ids {
            self.offered.remove(id);
            self.acquired.insert(*id);
        }
        Some(Action::Acquire(ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(id: i64) -> JobFacts {
        JobFacts {
            runner_request_id: id,
            ..JobFacts::default()
        }
    }

    fn message(id: i64, jobs: Vec<JobMessage>) -> QueueMessage {
        QueueMessage {
            id,
            jobs,
            statistics: Statistics::default(),
        }
    }

    #[test]
    fn runner_names_round_trip_and_foreign_names_are_not_ours() {
        let name = runner_name("0a1b", 3);
        assert_eq!(parse_runner_name(&name), Some(("0a1b".into(), 3)));
        for foreign in [
            "arc-runner-x",
            "jr-",
            "jr-abc",
            "jr-abc-0",
            "jr--1",
            "self-hosted",
        ] {
            assert_eq!(parse_runner_name(foreign), None, "{foreign}");
        }
    }

    #[test]
    fn only_what_there_is_room_for_is_acquired() {
        let mut state = ListenerState::default();
        let offered = message(
            1,
            (1..=5).map(|i| JobMessage::Available(facts(i))).collect(),
        );
        let actions = state.on_message(&offered, 3);
        assert_eq!(
            actions,
            vec![Action::Acquire(vec![1, 2, 3]), Action::Delete(1)]
        );
        // The three acquired still count against the room until they are assigned.
        let again = state.on_message(&message(2, vec![JobMessage::Available(facts(4))]), 3);
        assert_eq!(again, vec![Action::Delete(2)]);
        state.acquire_answered(&[1, 2, 3], &[1]);
        // Room freed up: the offers there was no room for are asked for, oldest first.
        assert_eq!(state.on_room(3), Some(Action::Acquire(vec![4, 5])));
        assert_eq!(state.on_room(3), None);
        // An offer not granted (taken elsewhere) is forgotten.
        state.acquire_answered(&[4, 5], &[4]);
        assert_eq!(state.acquired(), 2);
    }

    #[test]
    fn an_assigned_job_is_checked_once_and_a_reassignment_again() {
        let mut state = ListenerState::default();
        let first = state.on_message(&message(1, vec![JobMessage::Assigned(facts(7))]), 0);
        assert_eq!(first, vec![Action::Check(facts(7)), Action::Delete(1)]);
        // Re-sent in a later message: nothing new.
        assert_eq!(
            state.on_message(&message(2, vec![JobMessage::Assigned(facts(7))]), 0),
            vec![Action::Delete(2)]
        );
        // No runner took it: cancelled, then assigned again, checked again. Nothing of
        // ours ended: no terminal.
        let lapsed = JobMessage::Completed {
            job: facts(7),
            result: "canceled".into(),
            runner_id: 0,
            runner_name: String::new(),
        };
        let actions =
            state.on_message(&message(3, vec![lapsed, JobMessage::Assigned(facts(7))]), 0);
        assert_eq!(actions, vec![Action::Check(facts(7)), Action::Delete(3)]);
    }

    #[test]
    fn start_and_completion_are_about_the_runner_whichever_job_it_took() {
        let mut state = ListenerState::new([("a".to_owned(), false), ("b".to_owned(), false)]);
        assert_eq!(state.free_runners(), vec!["a".to_owned(), "b".to_owned()]);
        let runner = runner_name("a", 1);
        let started = JobMessage::Started {
            job: facts(9),
            runner_id: 4,
            runner_name: runner.clone(),
        };
        let actions = state.on_message(&message(2, vec![started]), 0);
        assert_eq!(
            actions,
            vec![
                Action::Claim {
                    job: facts(9),
                    assignment: "a".into(),
                    runner_name: runner.clone(),
                    runner_id: 4
                },
                Action::Delete(2),
            ]
        );
        assert_eq!(state.free_runners(), vec!["b".to_owned()]);
        assert_eq!(state.busy_runners(), 1);
        let done = JobMessage::Completed {
            job: facts(9),
            result: "succeeded".into(),
            runner_id: 4,
            runner_name: runner,
        };
        let actions = state.on_message(&message(3, vec![done]), 0);
        assert_eq!(
            actions[0],
            Action::Finish {
                job: facts(9),
                assignment: "a".into(),
                outcome: Outcome::Succeeded
            }
        );
        assert_eq!(state.busy_runners(), 0);
        // A job on a runner jetrunner did not make: nothing of ours.
        let foreign = JobMessage::Completed {
            job: facts(10),
            result: "failed".into(),
            runner_id: 1,
            runner_name: "arc-1".into(),
        };
        assert_eq!(
            state.on_message(&message(4, vec![foreign]), 0),
            vec![Action::Delete(4)]
        );
    }

    #[test]
    fn refused_jobs_are_not_demand_until_their_completion() {
        let mut state = ListenerState::default();
        let mut assigned = message(1, vec![JobMessage::Assigned(facts(1))]);
        assigned.statistics.total_assigned_jobs = 1;
        state.on_message(&assigned, 0);
        assert_eq!(state.demand().waiting, 1);
        state.job_refused(&facts(1));
        assert_eq!(state.demand().waiting, 0);
        let mut cancelled = message(
            2,
            vec![JobMessage::Completed {
                job: facts(1),
                result: "canceled".into(),
                runner_id: 0,
                runner_name: String::new(),
            }],
        );
        cancelled.statistics.total_assigned_jobs = 0;
        state.on_message(&cancelled, 0);
        assert!(state.demand().idle);
        // A refusal for a job no longer held is nothing.
        state.job_refused(&facts(1));
        assert_eq!(state.demand().waiting, 0);
    }
}
