//! Subject builders and parsers (docs/architecture.md, "Subjects and streams"):
//! `jr.assignment.<backend>.<assignment-id>`, `jr.event.<backend>.<assignment-id>.<kind>`,
//! `jr.command.<target>.<kind>`.

use crate::ids::{AssignmentId, BackendName};
use crate::message::Kind;

pub const ASSIGNMENTS_ALL: &str = "jr.assignment.>";
pub const EVENTS_ALL: &str = "jr.event.>";
pub const COMMANDS_ALL: &str = "jr.command.>";
/// Command target of the scheduler (backends use their own name as target).
pub const SCHEDULER_TARGET: &str = "scheduler";

pub fn assignment(backend: &BackendName, id: AssignmentId) -> String {
    format!("jr.assignment.{backend}.{id}")
}

/// Filter for one backend's assignment consumer.
pub fn assignments_of(backend: &BackendName) -> String {
    format!("jr.assignment.{backend}.>")
}

pub fn event(backend: &BackendName, id: AssignmentId, kind: Kind) -> String {
    format!("jr.event.{backend}.{id}.{kind}")
}

/// Filter for one kind of event across all assignments of all backends.
pub fn events_of_kind(kind: Kind) -> String {
    format!("jr.event.*.*.{kind}")
}

pub fn command(target: &str, kind: Kind) -> String {
    format!("jr.command.{target}.{kind}")
}

pub fn commands_for(target: &str) -> String {
    format!("jr.command.{target}.>")
}

/// What a subject says about its message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParsedSubject {
    Assignment {
        backend: BackendName,
        id: AssignmentId,
    },
    Event {
        backend: BackendName,
        id: AssignmentId,
        kind: Kind,
    },
    Command {
        target: String,
        kind: Kind,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("not a jetrunner subject: {0:?}")]
pub struct BadSubject(pub String);

pub fn parse(subject: &str) -> Result<ParsedSubject, BadSubject> {
    let bad = || BadSubject(subject.to_owned());
    let parts: Vec<&str> = subject.split('.').collect();
    match parts.as_slice() {
        ["jr", "assignment", backend, id] => Ok(ParsedSubject::Assignment {
            backend: BackendName::new(*backend).map_err(|_| bad())?,
            id: id.parse().map_err(|_| bad())?,
        }),
        ["jr", "event", backend, id, kind] => Ok(ParsedSubject::Event {
            backend: BackendName::new(*backend).map_err(|_| bad())?,
            id: id.parse().map_err(|_| bad())?,
            kind: Kind::parse(kind).filter(|k| k.is_event()).ok_or_else(bad)?,
        }),
        ["jr", "command", target, kind] if !target.is_empty() => Ok(ParsedSubject::Command {
            target: (*target).to_owned(),
            kind: Kind::parse(kind)
                .filter(|k| matches!(k, Kind::DeleteWorkload | Kind::FailTask | Kind::Redispatch))
                .ok_or_else(bad)?,
        }),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_round_trip_through_the_parser() {
        let backend = BackendName::new("pod").expect("valid");
        let id = AssignmentId::for_task("https://f", 7);
        assert_eq!(
            parse(&assignment(&backend, id)),
            Ok(ParsedSubject::Assignment {
                backend: backend.clone(),
                id
            })
        );
        assert_eq!(
            parse(&event(&backend, id, Kind::Claimed)),
            Ok(ParsedSubject::Event {
                backend,
                id,
                kind: Kind::Claimed
            })
        );
        assert_eq!(
            parse(&command(SCHEDULER_TARGET, Kind::FailTask)),
            Ok(ParsedSubject::Command {
                target: "scheduler".into(),
                kind: Kind::FailTask
            })
        );
    }

    #[test]
    fn foreign_subjects_are_refused() {
        for s in [
            "",
            "jr",
            "jr.assignment.pod",
            "jr.assignment.pod.not-a-uuid",
            "x.event.a.b.c",
            "jr.event.pod.6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1.assignment",
            "jr.command.pod.claimed",
        ] {
            assert!(parse(s).is_err(), "{s} parsed");
        }
    }
}
