-- jetrunner projection (docs/architecture.md, "Projector"). Written only by the reconciler's projector; disposable:
-- TRUNCATE everything and replay JR_ASSIGNMENTS and JR_EVENTS to rebuild the same rows.
-- Times are timestamptz with millisecond precision (converted from the envelopes' unix ms).

CREATE FUNCTION jr_ts(ms bigint) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT to_timestamp(ms::numeric / 1000) $$;

CREATE FUNCTION jr_ms(ts timestamptz) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT (extract(epoch FROM ts) * 1000)::bigint $$;

-- One row per assignment id seen on either stream. Routing columns are NULL while only events
-- are known. `state` and the lifecycle times are derived from the other tables on every write.
CREATE TABLE assignments (
    id                 uuid PRIMARY KEY,
    forge_instance     text,
    forge_task_id      bigint,
    backend            text,
    provider           text,
    labels             text[] NOT NULL DEFAULT '{}',
    repository         text,
    job_name           text,
    max_duration_secs  bigint,
    current_attempt    integer NOT NULL,
    state              text NOT NULL CHECK (state IN
                           ('pending', 'starting', 'running', 'finishing', 'completed', 'failed')),
    fetched_at         timestamptz,
    first_published_at timestamptz,
    last_published_at  timestamptz,
    first_workload_at  timestamptz,
    claimed_at         timestamptz,
    terminal_at        timestamptz,
    failed_at          timestamptz,
    finished_at        timestamptz,
    updated_at         timestamptz NOT NULL
);
CREATE INDEX assignments_open ON assignments (id) WHERE state NOT IN ('completed', 'failed');
CREATE INDEX assignments_backend_state ON assignments (backend, state);
CREATE INDEX assignments_forge_task ON assignments (forge_instance, forge_task_id);

-- One row per attempt (assignment message published n times = n attempts). Observation and
-- release columns mirror the attempt's own workload row for readability.
CREATE TABLE attempts (
    assignment_id    uuid NOT NULL,
    attempt          integer NOT NULL,
    backend          text,
    workload         text,
    token_hash       text,
    worker_id        text,
    published_at     timestamptz,
    requested_at     timestamptz,
    created_at       timestamptz,
    observed_phase   text,
    phase_reason     text,
    last_observed_at timestamptz,
    released_at      timestamptz,
    holds_slot       boolean NOT NULL,
    PRIMARY KEY (assignment_id, attempt)
);
CREATE INDEX attempts_slots ON attempts (backend) WHERE holds_slot;

-- Once-only: the executor of `attempt` received the forge task.
CREATE TABLE claims (
    assignment_id uuid PRIMARY KEY,
    attempt       integer NOT NULL,
    forge_task_id bigint NOT NULL,
    executor      text NOT NULL,
    claimed_at    timestamptz NOT NULL
);

-- Once-only final result; the row may exist with result NULL when `executor-finished` was
-- projected before `terminal`.
CREATE TABLE terminal_markers (
    assignment_id        uuid PRIMARY KEY,
    attempt              integer,
    forge_task_id        bigint,
    result               text,
    source               text,
    log_closed           boolean NOT NULL,
    reason               text,
    at                   timestamptz,
    executor_finished_at timestamptz
);

CREATE TABLE task_failures (
    assignment_id uuid PRIMARY KEY,
    attempt       integer NOT NULL,
    forge_task_id bigint NOT NULL,
    reason        text NOT NULL,
    failed_at     timestamptz NOT NULL
);

CREATE TABLE redispatches (
    assignment_id uuid NOT NULL,
    next_attempt  integer NOT NULL,
    from_attempt  integer NOT NULL,
    reason        text NOT NULL,
    at            timestamptz NOT NULL,
    PRIMARY KEY (assignment_id, next_attempt)
);

-- Every workload reference a worker reported (created, observed or released). A row that is
-- not released and whose attempt is not the live one is an orphan to delete.
CREATE TABLE workloads (
    backend           text NOT NULL,
    workload          text NOT NULL,
    assignment_id     uuid NOT NULL,
    attempt           integer NOT NULL,
    first_seen        timestamptz NOT NULL,
    created_at        timestamptz,
    phase             text,
    reason            text,
    last_seen         timestamptz,
    observed_seq      bigint,
    unreachable_since timestamptz,
    released_at       timestamptz,
    PRIMARY KEY (backend, workload)
);
CREATE INDEX workloads_assignment ON workloads (assignment_id);

-- Last stream sequence applied, written in the same transaction as the rows.
CREATE TABLE projector_checkpoint (
    stream   text PRIMARY KEY,
    last_seq bigint NOT NULL
);

-- Messages the projector could not apply (undecodable, refused at decode, or refused by the
-- database), one row per stream sequence. The projection skips them and moves on; operators
-- read them here, on the status page and as the `projection_quarantined` metric. Replaying the
-- streams records the same rows again (idempotent on stream and sequence).
CREATE TABLE quarantine (
    stream         text NOT NULL,
    seq            bigint NOT NULL,
    subject        text NOT NULL,
    reason         text NOT NULL,
    raw_size       bigint NOT NULL,
    quarantined_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, seq)
);

-- Why the assignment runs on its backend: the trust decision over the forge context, as the
-- scheduler recorded it on the assignment message (kept from attempt 1 across redispatches).
ALTER TABLE assignments ADD COLUMN placement text;
