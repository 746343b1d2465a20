
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
