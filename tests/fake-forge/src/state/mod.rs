//! The forge's state machine: registration, auth, queue and picking, as Gitea does them.
//! Pure: every method takes `now` and returns a reply or an `RpcError`; no IO here.

mod fetch;
pub(crate) use fetch::FetchCall;
mod update;
mod view;

use std::collections::BTreeMap;
use std::time::SystemTime;

use jr_forge::proto::runner::v1 as pb;

use crate::config::Behaviour;
use crate::error::RpcError;
use crate::model::{FaultCounters, JobId, JobSpec, Outcome, Status, StopCause};

use crate::faults::Rpc;

#[derive(Debug)]
pub(crate) struct RunnerRecord {
    id: i64,
    uuid: String,
    token: String,
    name: String,
    version: String,
    labels: Vec<String>,
    ephemeral: bool,
    last_online: SystemTime,
    last_active: Option<SystemTime>,
    deleted: bool,
}

#[derive(Debug)]
pub(crate) enum JobPhase {
    /// `seq` orders waiting jobs oldest first.
    Waiting {
        seq: u64,
        since: SystemTime,
    },
    Running {
        task_id: i64,
    },
    Done(Outcome),
}

#[derive(Debug)]
pub(crate) struct JobRecord {
    id: JobId,
    spec: JobSpec,
    phase: JobPhase,
    attempt: u32,
    fetch_count: u32,
    abandoned: bool,
    task_ids: Vec<i64>,
}

#[derive(Debug)]
pub(crate) enum TaskPhase {
    Running,
    Done {
        outcome: Outcome,
        stopped_at: SystemTime,
        cause: StopCause,
    },
}

#[derive(Debug)]
pub(crate) struct StepRecord {
    status: Status,
    log_index: i64,
    log_length: i64,
}

#[derive(Debug)]
pub(crate) struct TaskRecord {
    id: i64,
    job_id: JobId,
    attempt: u32,
    runner_uuid: String,
    runner_name: String,
    started: SystemTime,
    /// Last heartbeat; what the zombie reaper looks at.
    updated: SystemTime,
    phase: TaskPhase,
    handed_out: u32,
    heartbeats: u32,
    final_reports: Vec<Outcome>,
    final_accepted: u32,
    log: Vec<String>,
    log_archived: bool,
    outputs: BTreeMap<String, String>,
    steps: Vec<StepRecord>,
}

#[derive(Debug)]
pub(crate) struct State {
    pub behaviour: Behaviour,
    pub faults: FaultCounters,
    server_url: String,
    /// Global-scope registration tokens → active. Rotating deactivates all older ones.
    registration_tokens: BTreeMap<String, bool>,
    current_registration_token: String,
    runners: BTreeMap<String, RunnerRecord>,
    jobs: BTreeMap<JobId, JobRecord>,
    waiting: BTreeMap<u64, JobId>,
    tasks: BTreeMap<i64, TaskRecord>,
    next_runner_id: i64,
    next_job_id: u64,
    next_wait_seq: u64,
    next_task_id: i64,
    tasks_version: i64,
    /// FetchTask calls in flight: (runner uuid, call sequence).
    fetches_in_flight: std::collections::BTreeSet<(String, u64)>,
    next_fetch_seq: u64,
    /// FetchTask calls that began while another call of the same runner was in flight.
    racing_fetches: std::collections::BTreeSet<u64>,
    /// Forgejo: (runner uuid, request key) → the tasks assigned under that key.
    request_keys: BTreeMap<(String, String), Vec<i64>>,
    /// Forgejo: request keys some call is using right now.
    keys_in_use: std::collections::BTreeSet<(String, String)>,
}

pub(crate) fn random_hex40() -> String {
    hex::encode(rand::random::<[u8; 20]>())
}

impl State {
    pub fn new(behaviour: Behaviour, server_url: String, registration_token: String) -> Self {
        Self {
            behaviour,
            faults: FaultCounters::default(),
            server_url,
            registration_tokens: BTreeMap::from([(registration_token.clone(), true)]),
            current_registration_token: registration_token,
            runners: BTreeMap::new(),
            jobs: BTreeMap::new(),
            waiting: BTreeMap::new(),
            tasks: BTreeMap::new(),
            next_runner_id: 1,
            next_job_id: 1,
            next_wait_seq: 0,
            next_task_id: 1,
            tasks_version: 0,
            fetches_in_flight: Default::default(),
            next_fetch_seq: 0,
            racing_fetches: Default::default(),
            request_keys: BTreeMap::new(),
            keys_in_use: Default::default(),
        }
    }

    pub fn registration_token(&self) -> &str {
        &self.current_registration_token
    }

    /// A new global token; every older one stops working for Register.
    pub fn rotate_registration_token(&mut self) -> String {
        let token = random_hex40();
        for active in self.registration_tokens.values_mut() {
            *active = false;
        }
        self.registration_tokens.insert(token.clone(), true);
        self.current_registration_token.clone_from(&token);
        token
    }

    #[expect(
        deprecated,
        reason = "legacy agent_labels is still honoured when labels is empty"
    )]
    pub fn register(
        &mut self,
        req: pb::RegisterRequest,
        now: SystemTime,
    ) -> Result<pb::RegisterResponse, RpcError> {
        if req.token.is_empty() || req.name.is_empty() {
            return Err(RpcError::missing_register_fields());
        }
        match self.registration_tokens.get(&req.token) {
            None => return Err(RpcError::registration_token_not_found()),
            Some(false) => return Err(RpcError::registration_token_invalidated()),
            Some(true) => {}
        }
        let labels = if req.labels.is_empty() {
            req.agent_labels
        } else {
            req.labels
        };
        let runner = RunnerRecord {
            id: self.next_runner_id,
            uuid: uuid::Uuid::new_v4().to_string(),
            token: random_hex40(),
            name: req.name.chars().take(255).collect(),
            version: req.version,
            labels,
            ephemeral: req.ephemeral,
            last_online: now,
            last_active: None,
            deleted: false,
        };
        self.next_runner_id += 1;
        let mut reply = runner_message(&runner);
        reply.token.clone_from(&runner.token);
        self.runners.insert(runner.uuid.clone(), runner);
        Ok(pb::RegisterResponse {
            runner: Some(reply),
        })
    }

    /// The auth interceptor: returns the caller's uuid.
    pub fn authenticate(
        &mut self,
        uuid: &str,
        token: &str,
        rpc: Rpc,
        now: SystemTime,
    ) -> Result<String, RpcError> {
        let runner = self
            .runners
            .get_mut(uuid)
            .filter(|r| !r.deleted && r.token == token)
            .ok_or_else(RpcError::unregistered)?;
        runner.last_online = now;
        if matches!(rpc, Rpc::UpdateTask | Rpc::UpdateLog) {
            runner.last_active = Some(now);
        }
        Ok(runner.uuid.clone())
    }

    pub fn declare(
        &mut self,
        caller: &str,
        req: pb::DeclareRequest,
    ) -> Result<pb::DeclareResponse, RpcError> {
        let runner = self
            .runners
            .get_mut(caller)
            .ok_or_else(RpcError::unregistered)?;
        runner.labels = req.labels;
        runner.version = req.version;
        let mut reply = runner_message(runner);
        reply.ephemeral = match self.behaviour.error_style {
            // Gitea's Declare reply leaves `ephemeral` unset; Forgejo fills it.
            crate::ErrorStyle::Gitea => false,
            crate::ErrorStyle::Forgejo => runner.ephemeral,
        };
        Ok(pb::DeclareResponse {
            runner: Some(reply),
        })
    }

    /// Soft-deletes a runner so its credentials stop working.
    pub fn remove_runner(&mut self, uuid: &str) -> bool {
        match self.runners.get_mut(uuid) {
            Some(r) if !r.deleted => {
                r.deleted = true;
                true
            }
            _ => false,
        }
    }

    /// The counter a global runner reads; created as 1 so a reply never says 0.
    fn latest_tasks_version(&mut self) -> i64 {
        if self.tasks_version == 0 {
            self.tasks_version = 1;
        }
        self.tasks_version
    }

    fn make_waiting(&mut self, id: JobId, now: SystemTime) -> JobPhase {
        let seq = self.next_wait_seq;
        self.next_wait_seq += 1;
        self.waiting.insert(seq, id);
        self.tasks_version = self.latest_tasks_version() + 1;
        JobPhase::Waiting { seq, since: now }
    }

    pub fn enqueue(&mut self, spec: JobSpec, now: SystemTime) -> JobId {
        let id = JobId(self.next_job_id);
        self.next_job_id += 1;
        let phase = self.make_waiting(id, now);
        let job = JobRecord {
            id,
            spec,
            phase,
            attempt: 0,
            fetch_count: 0,
            abandoned: false,
            task_ids: Vec::new(),
        };
        self.jobs.insert(id, job);
        id
    }

    /// Puts a finished job back in the queue (a re-run: the next pick makes a new task).
    pub fn rerun(&mut self, id: JobId, now: SystemTime) -> bool {
        if !matches!(
            self.jobs.get(&id).map(|j| &j.phase),
            Some(JobPhase::Done(_))
        ) {
            return false;
        }
        let phase = self.make_waiting(id, now);
        if let Some(job) = self.jobs.get_mut(&id) {
            job.phase = phase;
            job.abandoned = false;
        }
        true
    }
}

fn runner_message(r: &RunnerRecord) -> pb::Runner {
    pb::Runner {
        id: r.id,
        uuid: r.uuid.clone(),
        name: r.name.clone(),
        version: r.version.clone(),
        labels: r.labels.clone(),
        ephemeral: r.ephemeral,
        ..Default::default()
    }
}
