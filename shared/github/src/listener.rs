//! What a scale set listener decides for each queue message, as a pure function of the
//! message, what it already tracks and how much room the backends have: which offered jobs to
//! acquire, which assigned jobs become jetrunner assignments, and which runner starts and job
//! completions become the once-only `claimed` and `terminal` facts. The driver performs the
//! actions in order and deletes the message only after all of them succeeded, so a crash
//! in between makes the service deliver the message again, and every decision here is
//! idempotent under that redelivery.
//!
//! Identity: each time GitHub assigns a job to the scale set it becomes one jetrunner
//! assignment, whose id is derived from the forge, the job (its `runnerRequestId`, or its
//! `jobId` where github.com sends 0 for the former: [`JobFacts::key`]) and the message that
//! assigned it. Everything about one job is keyed the same way here, and the ledger names the
//! job by the matching number, [`JobFacts::task_id`]. A job the service assigns again after
//! its runner never started (it sends `JobCompleted{canceled}` first) gets a new assignment.
//!
//! Runners are not bound to jobs: the service hands any job assigned to the scale set to any
//! idle runner of it. The JIT runner made for one assignment (named `jr-<assignment>-<attempt>`)
//! may run another assignment's job. So in jetrunner's ledger a GitHub assignment stands for
//! the *runner* made when a job was assigned: `JobStarted` claims the assignment of the runner
//! it names (with the job that runner took), and `JobCompleted` ends that runner's assignment.
//! The workload that is deleted after the terminal is then the one that ran the job, as for a
//! Gitea job. The number of runners stays the number of jobs assigned and not yet started:
//! when a job ends without running on a runner of ours (cancelled while queued, or taken by a
//! runner jetrunner did not make) one idle runner is too many, and it is withdrawn.

use std::collections::{BTreeMap, BTreeSet};

use crate::wire::{JobFacts, JobMessage, QueueMessage};

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
    /// Publish the assignment (once-only by its id) for a job assigned to the scale set, with
    /// a JIT runner for attempt 1.
    Assign { assignment: String, job: JobFacts },
    /// Runner `runner_name` (the runner made for `assignment`) took `job`: the once-only claim
    /// of the runner's assignment.
    Claim {
        job: JobFacts,
        assignment: String,
        runner_name: String,
        runner_id: i64,
    },
    /// `job` is over on the runner made for `assignment`: the once-only terminal of the
    /// runner's assignment.
    Finish {
        job: JobFacts,
        assignment: String,
        outcome: Outcome,
    },
    /// `job` ended, or started, without a runner of ours, while a runner was made for it: one
    /// idle runner is too many. Withdraw one, the job's own (`own`, when known) first, then the
    /// others not known to be busy (`others`).
    Withdraw {
        job: JobFacts,
        own: Option<String>,
        others: Vec<String>,
        outcome: Outcome,
    },
    /// Delete the message: everything above is done.
    Delete(i64),
}

/// A job this listener holds an assignment for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tracked {
    pub assignment: String,
    pub started: bool,
}

/// The listener's memory: the jobs it holds (rebuilt from the ledger after a restart) and the
/// jobs it asked for that are not assigned yet.
#[derive(Clone, Debug, Default)]
pub struct ListenerState {
    forge: String,
    /// By [`JobFacts::key`].
    jobs: BTreeMap<String, Tracked>,
    acquired: BTreeSet<i64>,
    /// Offered jobs there was no room for, oldest first: asked for when room frees up (whether
    /// the service offers them again is not documented; a job taken elsewhere is simply not
    /// granted).
    offered: BTreeSet<i64>,
    /// Assignments whose runner is not known to have taken a job: the candidates for a
    /// withdrawal (this process's memory; the ledger checks each one).
    idle: BTreeSet<String>,
}

impl ListenerState {
    pub fn new(forge: &str, known: BTreeMap<String, Tracked>) -> ListenerState {
        ListenerState {
            forge: forge.to_owned(),
            jobs: known,
            acquired: BTreeSet::new(),
            offered: BTreeSet::new(),
            idle: BTreeSet::new(),
        }
    }

    /// The runner of `assignment` was published: it may take a job.
    pub fn runner_published(&mut self, assignment: &str) {
        self.idle.insert(assignment.to_owned());
    }

    /// The runner of `assignment` is gone or busy: it takes no job any more.
    pub fn runner_withdrawn(&mut self, assignment: &str) {
        self.idle.remove(assignment);
    }

    /// Runners published and not known to have taken a job.
    pub fn idle_runners(&self) -> usize {
        self.idle.len()
    }

    pub fn tracked(&self) -> &BTreeMap<String, Tracked> {
        &self.jobs
    }

    /// Jobs acquired and not yet assigned: they will take slots soon.
    pub fn acquired(&self) -> usize {
        self.acquired.len()
    }

    fn withdraw(&self, job: &JobFacts, own: Option<String>, outcome: Outcome) -> Action {
        let others = self
            .idle
            .iter()
            .filter(|a| Some(*a) != own.as_ref())
            .cloned()
            .collect();
        Action::Withdraw {
            job: job.clone(),
            own,
            others,
            outcome,
        }
    }

    /// The assignment id of the job `job` (its [`JobFacts::key`]) assigned by message
    /// `message`.
    pub fn assignment_id(&self, job: &str, message: i64) -> String {
        use sha2::Digest;
        let mut hasher = sha2::Sha256::new();
        hasher.update(b"jetrunner github assignment\0");
        hasher.update(self.forge.as_bytes());
        hasher.update(b"\0");
        hasher.update(job.as_bytes());
        hasher.update(b"\0");
        hasher.update(message.to_be_bytes());
        let digest = hasher.finalize();
        digest[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The actions for `message`. `room` is how many more jobs the backends can start soon
    /// (free slots less what is queued for them); acquired-but-unassigned jobs count against it.
    pub fn on_message(&mut self, message: &QueueMessage, room: usize) -> Vec<Action> {
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
                    let key = facts.key();
                    self.acquired.remove(&id);
                    self.offered.remove(&id);
                    // A job already held is a re-sent message, not a second assignment.
                    if !self.jobs.contains_key(&key) {
                        let assignment = self.assignment_id(&key, message.id);
                        self.jobs.insert(
                            key,
                            Tracked {
                                assignment: assignment.clone(),
                                started: false,
                            },
                        );
                        actions.push(Action::Assign {
                            assignment,
                            job: facts.clone(),
                        });
                    }
                }
                JobMessage::Started {
                    job,
                    runner_id,
                    runner_name,
                } => {
                    let own = self.jobs.get_mut(&job.key()).map(|t| {
                        t.started = true;
                        t.assignment.clone()
                    });
                    match parse_runner_name(runner_name) {
                        Some((assignment, _)) => {
                            self.idle.remove(&assignment);
                            actions.push(Action::Claim {
                                job: job.clone(),
                                assignment,
                                runner_name: runner_name.clone(),
                                runner_id: *runner_id,
                            });
                        }
                        None => {
                            tracing::warn!(%runner_name, job = %job.key(), "a job of this scale set started on a runner jetrunner did not make");
                            actions.push(self.withdraw(job, own, Outcome::Cancelled));
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
                    let held = self.jobs.remove(&job.key());
                    self.acquired.remove(&id);
                    self.offered.remove(&id);
                    let outcome = Outcome::from_result(result);
                    match parse_runner_name(runner_name) {
                        Some((assignment, _)) => {
                            self.idle.remove(&assignment);
                            actions.push(Action::Finish {
                                job: job.clone(),
                                assignment,
                                outcome,
                            });
                        }
                        // It ran on a runner jetrunner did not make: withdrawn when it started.
                        None if !runner_name.is_empty() => {}
                        // It never ran (cancelled while queued, or its assignment lapsed).
                        None => {
                            let own = held.map(|t| t.assignment);
                            actions.push(self.withdraw(job, own, outcome));
                        }
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
    use crate::wire::Statistics;

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
        let mut state = ListenerState::new("gh", BTreeMap::new());
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
    fn a_re_sent_assignment_is_one_assignment_and_a_reassignment_is_another() {
        let mut state = ListenerState::new("gh", BTreeMap::new());
        let first = state.on_message(&message(1, vec![JobMessage::Assigned(facts(7))]), 0);
        let Action::Assign { assignment, .. } = &first[0] else {
            panic!("{first:?}")
        };
        let assignment = assignment.clone();
        // Re-sent in a later message: nothing new.
        assert_eq!(
            state.on_message(&message(2, vec![JobMessage::Assigned(facts(7))]), 0),
            vec![Action::Delete(2)]
        );
        // Redelivered after a crash to a listener that rebuilt its memory: the same id.
        let mut restarted = ListenerState::new("gh", BTreeMap::new());
        let redelivered =
            restarted.on_message(&message(1, vec![JobMessage::Assigned(facts(7))]), 0);
        assert!(
            matches!(&redelivered[0], Action::Assign { assignment: a, .. } if *a == assignment)
        );
        // The runner never started: cancelled, then assigned again, as a new assignment.
        let lapsed = JobMessage::Completed {
            job: facts(7),
            result: "canceled".into(),
            runner_id: 0,
            runner_name: String::new(),
        };
        let actions =
            state.on_message(&message(3, vec![lapsed, JobMessage::Assigned(facts(7))]), 0);
        // It never ran: the runner made for it is one too many.
        assert!(
            matches!(&actions[0], Action::Withdraw { job, own: Some(a), outcome: Outcome::Cancelled, .. } if *a == assignment && job.runner_request_id == 7),
            "{actions:?}"
        );
        assert!(
            matches!(&actions[1], Action::Assign { assignment: a, .. } if *a != assignment),
            "{actions:?}"
        );
    }

    #[test]
    fn start_and_completion_are_about_the_runner_whichever_job_it_took() {
        let mut state = ListenerState::new("gh", BTreeMap::new());
        let actions = state.on_message(
            &message(
                1,
                vec![
                    JobMessage::Assigned(facts(8)),
                    JobMessage::Assigned(facts(9)),
                ],
            ),
            0,
        );
        let ids: Vec<String> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Assign { assignment, .. } => Some(assignment.clone()),
                _ => None,
            })
            .collect();
        for id in &ids {
            state.runner_published(id);
        }
        // Job 9 runs on the runner made for job 8's assignment: the claim and the terminal
        // are that runner's assignment's, with job 9 in them.
        let runner = runner_name(&ids[0], 1);
        let started = JobMessage::Started {
            job: facts(9),
            runner_id: 4,
            runner_name: runner.clone(),
        };
        let done = JobMessage::Completed {
            job: facts(9),
            result: "succeeded".into(),
            runner_id: 4,
            runner_name: runner.clone(),
        };
        let actions = state.on_message(&message(2, vec![started, done]), 0);
        assert_eq!(
            actions,
            vec![
                Action::Claim {
                    job: facts(9),
                    assignment: ids[0].clone(),
                    runner_name: runner.clone(),
                    runner_id: 4
                },
                Action::Finish {
                    job: facts(9),
                    assignment: ids[0].clone(),
                    outcome: Outcome::Succeeded
                },
                Action::Delete(2),
            ]
        );
        // Job 8 is cancelled before it runs: job 9's runner is idle and too many. It is
        // the job's own runner that is busy, so the others are offered.
        let cancelled = JobMessage::Completed {
            job: facts(8),
            result: "canceled".into(),
            runner_id: 0,
            runner_name: String::new(),
        };
        let actions = state.on_message(&message(3, vec![cancelled]), 0);
        assert_eq!(
            actions[0],
            Action::Withdraw {
                job: facts(8),
                own: Some(ids[0].clone()),
                others: vec![ids[1].clone()],
                outcome: Outcome::Cancelled
            }
        );
        // A job started on a runner jetrunner did not make: one of ours is too many; its
        // completion there is nothing of ours.
        let mut fresh = ListenerState::new("gh", BTreeMap::new());
        let foreign = |kind| match kind {
            0 => JobMessage::Started {
                job: facts(10),
                runner_id: 1,
                runner_name: "arc-1".into(),
            },
            _ => JobMessage::Completed {
                job: facts(10),
                result: "failed".into(),
                runner_id: 1,
                runner_name: "arc-1".into(),
            },
        };
        let actions = fresh.on_message(&message(6, vec![foreign(0), foreign(1)]), 0);
        assert!(
            matches!(
                &actions[..],
                [Action::Withdraw { job, own: None, .. }, Action::Delete(6)] if job.runner_request_id == 10
            ),
            "{actions:?}"
        );
    }

    #[test]
    fn jobs_without_a_request_id_are_told_apart_by_their_job_id() {
        let mut state = ListenerState::new("gh", BTreeMap::new());
        let job = |id: &str| JobFacts {
            runner_request_id: 0,
            job_id: id.into(),
            ..JobFacts::default()
        };
        let actions = state.on_message(
            &message(
                1,
                vec![
                    JobMessage::Assigned(job("a")),
                    JobMessage::Assigned(job("b")),
                ],
            ),
            0,
        );
        let assigned: Vec<&String> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Assign { assignment, .. } => Some(assignment),
                _ => None,
            })
            .collect();
        assert_eq!(assigned.len(), 2, "{actions:?}");
        assert_ne!(assigned[0], assigned[1]);
        let done = JobMessage::Completed {
            job: job("b"),
            result: "canceled".into(),
            runner_id: 0,
            runner_name: String::new(),
        };
        let actions = state.on_message(&message(2, vec![done]), 0);
        assert!(
            matches!(&actions[0], Action::Withdraw { own: Some(a), .. } if a == assigned[1]),
            "{actions:?}"
        );
        // Offers without a request id cannot be acquired.
        let offered = state.on_message(&message(3, vec![JobMessage::Available(job("c"))]), 5);
        assert_eq!(offered, vec![Action::Delete(3)]);
    }
}
