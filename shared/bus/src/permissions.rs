//! Least-privilege NATS users: what each jetrunner service may publish and subscribe to, and
//! the `authorization` block of a nats-server configuration that grants exactly that.
//!
//! Pure functions: the scenario harness, the compose and k8s NATS configurations and the
//! permission tests all come from [`permissions`], so they cannot drift apart.
//!
//! What each service needs (everything else is refused by the server):
//! - **scheduler**: publishes every assignment (`jr.assignment.>`) and its own event kinds
//!   (`claimed`, `terminal`, `task-failed`, `redispatched`, `executor-finished`); pulls and acks
//!   its durable `scheduler` on `JR_COMMANDS`; reads single messages and replays
//!   `JR_ASSIGNMENTS`/`JR_EVENTS` with ordered consumers; reads the pending counts of the
//!   workers' durables (pacing); owns the KV bucket `JR_SCHEDULER` (Forgejo request keys, fetch leases);
//!   reads the warm bindings in `JR_WARM_<backend>` and subscribes to their wake-ups `jr.warm.>`;
//!   reads the key `slots` of each `JR_WORKLOADS_<backend>` (whether a worker lives); owns the
//!   KV bucket `JR_INTAKES` (what each registration fetches, and why not).
//! - **`<backend>-worker`**: publishes only its backend's worker events
//!   (`jr.event.<backend>.*.{workload-requested,workload-created,workload-observed,released}`);
//!   pulls and acks its two durables `<backend>-worker` (filters fixed in the create subject);
//!   reads single messages of `JR_ASSIGNMENTS`/`JR_EVENTS`; owns the KV buckets
//!   `JR_WORKLOADS_<backend>` and `JR_WARM_<backend>` (warm bindings) and publishes the core
//!   wake-ups `jr.warm.<backend>.*`; reads the placement switches in the KV bucket `JR_PLACEMENT`.
//! - **reconciler**: publishes only commands (`jr.command.<backend>.delete-workload`,
//!   `jr.command.scheduler.fail-task`, `jr.command.scheduler.redispatch`); replays
//!   `JR_ASSIGNMENTS`/`JR_EVENTS` with ordered consumers; reads the workers' pending counts;
//!   owns (creates) the KV bucket `JR_PLACEMENT` of the placement switches and the KV bucket
//!   `JR_RECONCILER` of its lease; reads `JR_INTAKES` (the status API).
//!
//! Where the grant is broader than one subject, and why:
//! - Ordered consumers are ephemeral with generated names, and NATS wildcards match whole
//!   tokens only, so the scheduler and the reconciler may create (by name), read, pull from and
//!   delete any consumer of `JR_ASSIGNMENTS`/`JR_EVENTS` — except the other services' durables,
//!   which are denied by name (a deny always wins). The nameless create endpoint is granted to
//!   nobody on these streams: there the name comes from the request body, and nats-server would
//!   update an existing durable of that name.
//! - The body of a consumer-create request is not subject to permissions: a scheduler or
//!   reconciler could create a push consumer on `JR_ASSIGNMENTS`/`JR_EVENTS` whose deliver
//!   subject is another jetrunner subject. nats-server refuses a deliver subject its own stream
//!   captures (a cycle) and delivers only where a subscriber has interest; the only core `jr.*`
//!   subscription is the scheduler's on `jr.warm.>`, whose messages only make it read a bucket
//!   again, and the consumers of every stream check what they act on.
//! - `$JS.API.STREAM.MSG.GET.<stream>` names the wanted subject in the request body, so a
//!   service that reads single messages may read any message of that stream (with replicas,
//!   last-message reads use it to reach the leader). A direct get of a subject's last message
//!   names the subject in the request subject, so workers are granted only their backend's. Nothing secret is
//!   in the clear on the bus (forge tasks are sealed), so reading is not an authority.
//! - Every service may create the three streams if they are missing (start order is free); a
//!   create never changes an existing stream. Only the scheduler and the reconciler, which own
//!   the stream limits, may update them. Nobody may delete or purge a stream.
//! - Replies come to a per-service inbox prefix (`_INBOX.<user>.>`), so a service cannot read
//!   another one's replies or pulled messages, and no service may publish to any inbox.

pub use jr_protocol::BackendName;
use jr_protocol::{Kind, STREAM_ASSIGNMENTS, STREAM_COMMANDS, STREAM_EVENTS, subject};

/// The KV bucket of the scheduler (Forgejo request keys).
pub const SCHEDULER_BUCKET: &str = "JR_SCHEDULER";

/// The KV bucket of the placement switches (key `burst`): the reconciler creates it, operators
/// set it (`jr burst`, or the NATS CLI as `admin`), workers read it.
pub const PLACEMENT_BUCKET: &str = "JR_PLACEMENT";

/// The KV bucket of the reconciler (its lease, key `lease.reconciler`).
pub const RECONCILER_BUCKET: &str = "JR_RECONCILER";

/// The KV bucket of a worker's ledger of announced workloads.
pub fn worker_bucket(backend: &BackendName) -> String {
    format!("JR_WORKLOADS_{backend}")
}

/// The key of a worker bucket holding its replicas' capacity record (who holds how many
/// slots, renewed every second): the scheduler reads it to know whether a worker lives.
pub const WORKER_SLOTS_KEY: &str = "slots";

/// The event kinds the scheduler publishes (the facade's facts, fail-task and redispatch).
pub const SCHEDULER_EVENT_KINDS: [Kind; 5] = [
    Kind::Claimed,
    Kind::Terminal,
    Kind::TaskFailed,
    Kind::Redispatched,
    Kind::ExecutorFinished,
];

/// The event kinds a worker publishes, on its own backend's subjects only.
pub const WORKER_EVENT_KINDS: [Kind; 4] = [
    Kind::WorkloadRequested,
    Kind::WorkloadCreated,
    Kind::WorkloadObserved,
    Kind::Released,
];

/// A jetrunner service as a NATS user.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Scheduler,
    Worker(BackendName),
    Reconciler,
}

impl Role {
    /// The NATS user name: `scheduler`, `<backend>-worker`, `reconciler` (also the durable
    /// consumer names of the scheduler and the workers).
    pub fn user(&self) -> String {
        match self {
            Role::Scheduler => "scheduler".to_owned(),
            Role::Worker(backend) => format!("{backend}-worker"),
            Role::Reconciler => "reconciler".to_owned(),
        }
    }

    /// The inbox prefix this service's replies and pulled messages arrive on.
    pub fn inbox_prefix(&self) -> String {
        format!("_INBOX.{}", self.user())
    }

    /// Every role of a deployment with these backends.
    pub fn all(backends: &[BackendName]) -> Vec<Role> {
        let mut roles = vec![Role::Scheduler];
        roles.extend(backends.iter().cloned().map(Role::Worker));
        roles.push(Role::Reconciler);
        roles
    }
}

/// Publish and subscribe grants of one user. An empty allow list would mean "everything" to
/// nats-server, so every role has at least one allowed subject.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permissions {
    pub publish_allow: Vec<String>,
    pub publish_deny: Vec<String>,
    pub subscribe_allow: Vec<String>,
}

const API: &str = "$JS.API";

fn stream_access(p: &mut Permissions, stream: &str, update: bool) {
    p.publish_allow.push(format!("{API}.STREAM.INFO.{stream}"));
    p.publish_allow
        .push(format!("{API}.STREAM.CREATE.{stream}"));
    if update {
        p.publish_allow
            .push(format!("{API}.STREAM.UPDATE.{stream}"));
    }
}

/// A durable pull consumer the role owns: create (with its filter fixed in the subject),
/// info, pull and ack.
fn own_durable(p: &mut Permissions, stream: &str, durable: &str, filter: &str) {
    p.publish_allow
        .push(format!("{API}.CONSUMER.CREATE.{stream}.{durable}.{filter}"));
    p.publish_allow
        .push(format!("{API}.CONSUMER.INFO.{stream}.{durable}"));
    p.publish_allow
        .push(format!("{API}.CONSUMER.MSG.NEXT.{stream}.{durable}"));
    p.publish_allow
        .push(format!("$JS.ACK.{stream}.{durable}.>"));
}

/// Ordered (ephemeral) consumers on `stream`; `others` are durables the role must not touch.
/// Only the named create endpoint is granted: through the nameless one a config naming an
/// existing durable updates it (nats-server takes the name from the body there), so ordered
/// consumers must be named ([`ordered_consumer_name`]).
fn ordered_consumers(p: &mut Permissions, stream: &str, others: &[String]) {
    for op in ["CREATE", "DELETE", "INFO", "MSG.NEXT"] {
        p.publish_allow
            .push(format!("{API}.CONSUMER.{op}.{stream}.*"));
    }
    p.publish_allow
        .push(format!("{API}.CONSUMER.CREATE.{stream}.*.>"));
    for durable in others {
        for op in ["CREATE", "DELETE", "MSG.NEXT"] {
            p.publish_deny
                .push(format!("{API}.CONSUMER.{op}.{stream}.{durable}"));
        }
        p.publish_deny
            .push(format!("{API}.CONSUMER.CREATE.{stream}.{durable}.>"));
    }
}

/// A fresh name for an ordered consumer of `user` (`<user>-<random>`). Ordered consumers must be
/// created with a name: the nameless create endpoint is not granted to anyone on the jetrunner
/// streams (see [`permissions`]).
pub fn ordered_consumer_name(user: &str) -> String {
    use rand::Rng as _;
    let mut rng = rand::rng();
    let suffix: String = (0..16)
        .map(|_| {
            let i = rng.random_range(0..36u8);
            char::from(if i < 10 { b'0' + i } else { b'a' + i - 10 })
        })
        .collect();
    format!("{user}-{suffix}")
}

/// A KV bucket the role owns.
fn own_bucket(p: &mut Permissions, bucket: &str, watch: bool) {
    let stream = format!("KV_{bucket}");
    p.publish_allow.push(format!("{API}.INFO"));
    stream_access(p, &stream, true);
    p.publish_allow.push(format!("$KV.{bucket}.>"));
    p.publish_allow.push(format!("{API}.DIRECT.GET.{stream}.>"));
    p.publish_allow
        .push(format!("{API}.STREAM.MSG.GET.{stream}"));
    if watch {
        // Listing keys runs an ordered push consumer with flow control.
        p.publish_allow
            .push(format!("{API}.CONSUMER.CREATE.{stream}"));
        p.publish_allow
            .push(format!("{API}.CONSUMER.CREATE.{stream}.>"));
        p.publish_allow
            .push(format!("{API}.CONSUMER.DELETE.{stream}.*"));
        p.publish_allow
            .push(format!("{API}.CONSUMER.INFO.{stream}.*"));
        p.publish_allow.push(format!("$JS.FC.{stream}.>"));
    }
}

/// What `role` may do in a deployment with `backends` (the enabled backends' names).
pub fn permissions(role: &Role, backends: &[BackendName]) -> Permissions {
    let mut p = Permissions {
        subscribe_allow: vec![format!("{}.>", role.inbox_prefix())],
        ..Permissions::default()
    };
    let worker_durables: Vec<String> = backends
        .iter()
        .map(|b| Role::Worker(b.clone()).user())
        .collect();
    let owns_limits = !matches!(role, Role::Worker(_));
    for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS, STREAM_COMMANDS] {
        stream_access(&mut p, stream, owns_limits);
    }
    match role {
        Role::Scheduler => {
            p.publish_allow.push(subject::ASSIGNMENTS_ALL.to_owned());
            for kind in SCHEDULER_EVENT_KINDS {
                p.publish_allow.push(subject::events_of_kind(kind));
            }
            let durable = role.user();
            own_durable(
                &mut p,
                STREAM_COMMANDS,
                &durable,
                &subject::commands_for(subject::SCHEDULER_TARGET),
            );
            for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS] {
                p.publish_allow
                    .push(format!("{API}.STREAM.MSG.GET.{stream}"));
                // Last message of a subject: the subject is part of the request subject.
                p.publish_allow
                    .push(format!("{API}.DIRECT.GET.{stream}.jr.>"));
                ordered_consumers(&mut p, stream, &worker_durables);
            }
            own_bucket(&mut p, SCHEDULER_BUCKET, false);
            own_bucket(&mut p, crate::intake::BUCKET, false);
            // Pacing reads whether a worker replica of each backend renews its capacity
            // holding (the `slots` key of the worker's bucket, and only that key).
            for backend in backends {
                let bucket = worker_bucket(backend);
                let stream = format!("KV_{bucket}");
                p.publish_allow.push(format!("{API}.STREAM.INFO.{stream}"));
                p.publish_allow.push(format!(
                    "{API}.DIRECT.GET.{stream}.$KV.{bucket}.{WORKER_SLOTS_KEY}"
                ));
            }
            // The facade reads warm executors' bindings and wakes on the workers' notices.
            for backend in backends {
                let bucket = crate::warm::bucket(backend);
                let stream = format!("KV_{bucket}");
                p.publish_allow.push(format!("{API}.STREAM.INFO.{stream}"));
                p.publish_allow
                    .push(format!("{API}.DIRECT.GET.{stream}.$KV.{bucket}.>"));
                p.publish_allow
                    .push(format!("{API}.STREAM.MSG.GET.{stream}"));
            }
            p.subscribe_allow.push(crate::warm::WAKE_ALL.to_owned());
        }
        Role::Worker(backend) => {
            for kind in WORKER_EVENT_KINDS {
                p.publish_allow.push(format!("jr.event.{backend}.*.{kind}"));
            }
            let durable = role.user();
            own_durable(
                &mut p,
                STREAM_ASSIGNMENTS,
                &durable,
                &subject::assignments_of(backend),
            );
            own_durable(
                &mut p,
                STREAM_COMMANDS,
                &durable,
                &subject::commands_for(backend.as_str()),
            );
            for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS] {
                p.publish_allow
                    .push(format!("{API}.STREAM.MSG.GET.{stream}"));
            }
            // Direct gets of the last message name the subject: only its own backend's.
            p.publish_allow.push(format!(
                "{API}.DIRECT.GET.{STREAM_ASSIGNMENTS}.{}",
                subject::assignments_of(backend)
            ));
            p.publish_allow.push(format!(
                "{API}.DIRECT.GET.{STREAM_EVENTS}.jr.event.{backend}.>"
            ));
            own_bucket(&mut p, &worker_bucket(backend), true);
            own_bucket(&mut p, &crate::warm::bucket(backend), false);
            p.publish_allow.push(format!("jr.warm.{backend}.*"));
            // Reads the burst switch; writing it is for operators.
            let placement = format!("KV_{PLACEMENT_BUCKET}");
            p.publish_allow
                .push(format!("{API}.STREAM.INFO.{placement}"));
            p.publish_allow.push(format!(
                "{API}.DIRECT.GET.{placement}.$KV.{PLACEMENT_BUCKET}.>"
            ));
            p.publish_allow
                .push(format!("{API}.STREAM.MSG.GET.{placement}"));
        }
        Role::Reconciler => {
            for backend in backends {
                p.publish_allow
                    .push(subject::command(backend.as_str(), Kind::DeleteWorkload));
            }
            for kind in [Kind::FailTask, Kind::Redispatch] {
                p.publish_allow
                    .push(subject::command(subject::SCHEDULER_TARGET, kind));
            }
            for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS] {
                ordered_consumers(&mut p, stream, &worker_durables);
            }
            own_bucket(&mut p, PLACEMENT_BUCKET, false);
            own_bucket(&mut p, RECONCILER_BUCKET, false);
            // The status API shows what each intake of the scheduler is doing.
            let intakes = format!("KV_{}", crate::intake::BUCKET);
            p.publish_allow.push(format!("{API}.STREAM.INFO.{intakes}"));
            p.publish_allow.push(format!(
                "{API}.DIRECT.GET.{intakes}.$KV.{}.>",
                crate::intake::BUCKET
            ));
            p.publish_allow
                .push(format!("{API}.STREAM.MSG.GET.{intakes}"));
        }
    }
    // The INFO grant may come twice (two buckets never, but keep the list tidy).
    p.publish_allow.dedup();
    p
}

/// How a user's password appears in the server configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Password {
    /// Written into the file (tests, local development).
    Literal(String),
    /// An environment variable of the nats-server process (`$NAME` in the file), e.g. filled
    /// from a Kubernetes Secret.
    Env(String),
}

/// One user of the server configuration.
#[derive(Clone, Debug)]
pub struct NatsUser {
    pub user: String,
    pub password: Password,
    /// `None`: every subject (an administrator or test harness).
    pub permissions: Option<Permissions>,
}

impl NatsUser {
    /// The service user of `role`.
    pub fn service(role: &Role, backends: &[BackendName], password: Password) -> Self {
        Self {
            user: role.user(),
            password,
            permissions: Some(permissions(role, backends)),
        }
    }
}

fn quoted(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn list(out: &mut String, key: &str, items: &[String], indent: usize) {
    let pad = " ".repeat(indent);
    out.push_str(&format!("{pad}{key}: [\n"));
    for item in items {
        out.push_str(&format!("{pad}  {}\n", quoted(item)));
    }
    out.push_str(&format!("{pad}]\n"));
}

/// The `authorization { users = [...] }` block of a nats-server configuration.
pub fn authorization_block(users: &[NatsUser]) -> String {
    let mut out = String::from("authorization {\n  users = [\n");
    for u in users {
        let password = match &u.password {
            Password::Literal(p) => quoted(p),
            Password::Env(var) => format!("${var}"),
        };
        out.push_str(&format!(
            "    {{\n      user: {}\n      password: {password}\n",
            quoted(&u.user)
        ));
        if let Some(p) = &u.permissions {
            out.push_str("      permissions: {\n        publish: {\n");
            list(&mut out, "allow", &p.publish_allow, 10);
            if !p.publish_deny.is_empty() {
                list(&mut out, "deny", &p.publish_deny, 10);
            }
            out.push_str("        }\n        subscribe: {\n");
            list(&mut out, "allow", &p.subscribe_allow, 10);
            out.push_str("        }\n      }\n");
        }
        out.push_str("    }\n");
    }
    out.push_str("  ]\n}\n");
    out
}

/// Whether NATS subject pattern `pattern` (with `*` and `>`) matches `subject`, token by
/// token, as nats-server matches permissions. A `>` or `*` token in `subject` is matched only
/// by a wildcard or the same literal token.
pub fn pattern_matches(pattern: &str, subject: &str) -> bool {
    let mut want = pattern.split('.');
    let mut have = subject.split('.');
    loop {
        match (want.next(), have.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(w), Some(h)) if w == h => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

impl Permissions {
    /// Whether the server lets this user publish on `subject` (deny wins over allow).
    pub fn may_publish(&self, subject: &str) -> bool {
        self.publish_allow
            .iter()
            .any(|p| pattern_matches(p, subject))
            && !self
                .publish_deny
                .iter()
                .any(|p| pattern_matches(p, subject))
    }

    /// Whether the server lets this user subscribe to the literal subject `subject`.
    pub fn may_subscribe(&self, subject: &str) -> bool {
        self.subscribe_allow
            .iter()
            .any(|p| pattern_matches(p, subject))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jr_protocol::AssignmentId;

    fn backends() -> Vec<BackendName> {
        ["pod", "vm"]
            .into_iter()
            .map(|b| BackendName::new(b).expect("valid"))
            .collect()
    }

    fn b(name: &str) -> BackendName {
        BackendName::new(name).expect("valid")
    }

    /// Pacing reads whether a worker lives from the `slots` key of its bucket, and nothing
    /// else there; the intake records are the scheduler's to write and the reconciler's to read.
    #[test]
    fn the_scheduler_reads_only_the_workers_capacity_records_and_writes_the_intake_records() {
        let backends = backends();
        let scheduler = permissions(&Role::Scheduler, &backends);
        let reconciler = permissions(&Role::Reconciler, &backends);
        for backend in &backends {
            let bucket = worker_bucket(backend);
            let slots = format!("$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{WORKER_SLOTS_KEY}");
            let other = format!("$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.ledger-key");
            assert!(scheduler.may_publish(&slots), "{slots}");
            assert!(!scheduler.may_publish(&other), "{other}");
            assert!(!scheduler.may_publish(&format!("$KV.{bucket}.slots")));
            assert!(!reconciler.may_publish(&slots));
        }
        let write = format!("$KV.{}.shared", crate::intake::BUCKET);
        let read = format!(
            "$JS.API.DIRECT.GET.KV_{0}.$KV.{0}.shared",
            crate::intake::BUCKET
        );
        for role in Role::all(&backends) {
            let p = permissions(&role, &backends);
            assert_eq!(p.may_publish(&write), role == Role::Scheduler, "{role:?}");
            assert_eq!(
                p.may_publish(&read),
                matches!(role, Role::Scheduler | Role::Reconciler),
                "{role:?}"
            );
        }
    }

    /// A warm binding decides which executor receives a job: only its backend's worker may
    /// write it (or wake the facade about it), and the scheduler may read every backend's.
    #[test]
    fn warm_bindings_are_written_by_their_worker_only_and_read_by_the_scheduler() {
        let backends = backends();
        let warm = AssignmentId::for_task("https://forge", 9);
        for backend in &backends {
            let bucket = crate::warm::bucket(backend);
            let write = format!("$KV.{bucket}.{warm}");
            let read = format!("$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{warm}");
            let wake = crate::warm::wake_subject(backend, warm);
            for role in Role::all(&backends) {
                let p = permissions(&role, &backends);
                let owner = role == Role::Worker(backend.clone());
                assert_eq!(p.may_publish(&write), owner, "{role:?} {write}");
                assert_eq!(p.may_publish(&wake), owner, "{role:?} {wake}");
                assert_eq!(
                    p.may_publish(&read),
                    owner || role == Role::Scheduler,
                    "{role:?} {read}"
                );
                assert_eq!(
                    p.may_subscribe(&wake),
                    role == Role::Scheduler,
                    "{role:?} subscribes {wake}"
                );
            }
        }
    }

    /// Who may publish each jetrunner subject: exactly the owner the design names.
    #[test]
    fn each_subject_has_exactly_its_owner() {
        let backends = backends();
        let id = AssignmentId::for_task("https://forge", 7);
        for role in Role::all(&backends) {
            let p = permissions(&role, &backends);
            for backend in &backends {
                let assignment = subject::assignment(backend, id);
                assert_eq!(
                    p.may_publish(&assignment),
                    role == Role::Scheduler,
                    "{role:?} {assignment}"
                );
                for kind in Kind::ALL {
                    let event = subject::event(backend, id, kind);
                    let owner = SCHEDULER_EVENT_KINDS.contains(&kind) && role == Role::Scheduler
                        || WORKER_EVENT_KINDS.contains(&kind)
                            && role == Role::Worker(backend.clone());
                    assert_eq!(p.may_publish(&event), owner, "{role:?} {event}");
                }
                let delete = subject::command(backend.as_str(), Kind::DeleteWorkload);
                assert_eq!(
                    p.may_publish(&delete),
                    role == Role::Reconciler,
                    "{role:?} {delete}"
                );
            }
            for kind in [Kind::FailTask, Kind::Redispatch] {
                let command = subject::command(subject::SCHEDULER_TARGET, kind);
                assert_eq!(
                    p.may_publish(&command),
                    role == Role::Reconciler,
                    "{role:?} {command}"
                );
            }
        }
    }

    #[test]
    fn nobody_deletes_streams_or_answers_inboxes_or_reads_other_inboxes() {
        let backends = backends();
        for role in Role::all(&backends) {
            let p = permissions(&role, &backends);
            for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS, STREAM_COMMANDS] {
                for op in ["DELETE", "PURGE", "MSG.DELETE"] {
                    let api = format!("$JS.API.STREAM.{op}.{stream}");
                    assert!(!p.may_publish(&api), "{role:?} {api}");
                }
            }
            assert!(!p.may_publish("_INBOX.scheduler.abc"), "{role:?}");
            assert!(!p.may_subscribe("jr.event.pod.x.claimed"), "{role:?}");
            for other in Role::all(&backends) {
                let inbox = format!("{}.abc", other.inbox_prefix());
                assert_eq!(p.may_subscribe(&inbox), other == role, "{role:?} {inbox}");
            }
            assert!(!p.publish_allow.is_empty() && !p.subscribe_allow.is_empty());
        }
    }

    #[test]
    fn nobody_creates_consumers_of_the_jetrunner_streams_without_a_name() {
        let backends = backends();
        for role in Role::all(&backends) {
            let p = permissions(&role, &backends);
            for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS, STREAM_COMMANDS] {
                let api = format!("$JS.API.CONSUMER.CREATE.{stream}");
                assert!(!p.may_publish(&api), "{role:?} {api}");
                let durable = format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.pod-worker");
                assert!(!p.may_publish(&durable), "{role:?} {durable}");
            }
        }
        let name = ordered_consumer_name("reconciler");
        assert!(name.starts_with("reconciler-") && !name.contains('.'));
        let p = permissions(&Role::Reconciler, &backends);
        assert!(p.may_publish(&format!("$JS.API.CONSUMER.CREATE.JR_EVENTS.{name}")));
    }

    #[test]
    fn only_the_limit_owners_update_streams() {
        let backends = backends();
        for role in Role::all(&backends) {
            let p = permissions(&role, &backends);
            let update = p.may_publish("$JS.API.STREAM.UPDATE.JR_EVENTS");
            assert_eq!(update, !matches!(role, Role::Worker(_)), "{role:?}");
            assert!(p.may_publish("$JS.API.STREAM.CREATE.JR_EVENTS"), "{role:?}");
        }
    }

    /// A worker's durables are its own: only it pulls, acks or creates them, and only
    /// with its own filter; the others may read their pending counts.
    #[test]
    fn worker_durables_belong_to_their_worker() {
        let backends = backends();
        let pod = Role::Worker(b("pod"));
        for role in Role::all(&backends) {
            let p = permissions(&role, &backends);
            let mine = role == pod;
            for (op, subject) in [
                (
                    "pull",
                    "$JS.API.CONSUMER.MSG.NEXT.JR_ASSIGNMENTS.pod-worker",
                ),
                ("ack", "$JS.ACK.JR_ASSIGNMENTS.pod-worker.1.2.3.4.5"),
                ("ack", "$JS.ACK.JR_COMMANDS.pod-worker.1.2.3.4.5"),
                (
                    "create",
                    "$JS.API.CONSUMER.CREATE.JR_ASSIGNMENTS.pod-worker.jr.assignment.pod.>",
                ),
                (
                    "create",
                    "$JS.API.CONSUMER.CREATE.JR_ASSIGNMENTS.pod-worker",
                ),
            ] {
                if op == "create" && subject.ends_with("pod-worker") {
                    // Without the filter in the subject the config could widen it: nobody.
                    assert!(!p.may_publish(subject), "{role:?} {subject}");
                    continue;
                }
                assert_eq!(p.may_publish(subject), mine, "{role:?} {op} {subject}");
            }
            // Nobody deletes a durable, not even its owner.
            let delete = "$JS.API.CONSUMER.DELETE.JR_ASSIGNMENTS.pod-worker";
            assert!(!p.may_publish(delete), "{role:?} {delete}");
            let widened = "$JS.API.CONSUMER.CREATE.JR_ASSIGNMENTS.pod-worker.jr.assignment.>";
            assert!(!p.may_publish(widened), "{role:?} {widened}");
            let info = "$JS.API.CONSUMER.INFO.JR_ASSIGNMENTS.pod-worker";
            assert_eq!(
                p.may_publish(info),
                role != Role::Worker(b("vm")),
                "{role:?} {info}"
            );
        }
    }

    #[test]
    fn the_pattern_matcher_matches_whole_tokens() {
        assert!(pattern_matches(
            "jr.event.*.*.claimed",
            "jr.event.pod.a.claimed"
        ));
        assert!(!pattern_matches(
            "jr.event.*.*.claimed",
            "jr.event.pod.a.b.claimed"
        ));
        assert!(pattern_matches("a.>", "a.b.c"));
        assert!(!pattern_matches("a.>", "a"));
        assert!(!pattern_matches("a.b", "a.b.c"));
        assert!(!pattern_matches("jr.event.pod-x.>", "jr.event.pod.y"));
        assert!(pattern_matches("x.*", "x.>"));
    }

    #[test]
    fn the_authorization_block_lists_every_user_and_grant() {
        let backends = vec![b("pod")];
        let users: Vec<NatsUser> = Role::all(&backends)
            .iter()
            .map(|r| {
                NatsUser::service(
                    r,
                    &backends,
                    Password::Env(format!("PW_{}", r.user().len())),
                )
            })
            .chain([NatsUser {
                user: "admin".into(),
                password: Password::Literal("a\"b".into()),
                permissions: None,
            }])
            .collect();
        let text = authorization_block(&users);
        for role in Role::all(&backends) {
            assert!(
                text.contains(&format!("user: \"{}\"", role.user())),
                "{text}"
            );
            for subject in permissions(&role, &backends).publish_allow {
                assert!(
                    text.contains(&format!("\"{subject}\"")),
                    "{subject} in {text}"
                );
            }
        }
        assert!(text.contains("password: $PW_9"), "{text}");
        assert!(text.contains("password: \"a\\\"b\""), "{text}");
        // Balanced braces and brackets: a truncated block would not parse.
        assert_eq!(text.matches('{').count(), text.matches('}').count());
        assert_eq!(text.matches('[').count(), text.matches(']').count());
    }
}
