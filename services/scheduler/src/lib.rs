//! The scheduler: jetrunner's only contact with the forges. It assembles the intakes (each
//! Gitea/Forgejo registration and each GitHub scale set, from `jr-gitea-intake` and
//! `jr-github-intake`), the executor facade (`jr-facade`) with its JetStream ledger, and the
//! handlers of the commands the reconciler sends it; each part runs as its own task.

pub mod commands;
pub mod ledger;
pub mod metrics;
pub mod service;
