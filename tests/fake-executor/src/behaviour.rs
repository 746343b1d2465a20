//! What a fake task does, read from the task's `vars` map (`JR_FAKE_*`).

use std::collections::BTreeMap;
use std::time::Duration;

/// `success` | `failure`; default `success`.
pub const VAR_OUTCOME: &str = "JR_FAKE_OUTCOME";
/// Total simulated work in milliseconds, spread evenly over the steps; default 100.
pub const VAR_DURATION_MS: &str = "JR_FAKE_DURATION_MS";
/// Number of steps; default 2.
pub const VAR_STEPS: &str = "JR_FAKE_STEPS";
/// Job outputs as a comma list `k=v,k2=v2`; default none.
pub const VAR_OUTPUTS: &str = "JR_FAKE_OUTPUTS";

const DEFAULT_DURATION_MS: u64 = 100;
const DEFAULT_STEPS: u32 = 2;
/// Keeps a typo (`JR_FAKE_STEPS=100000`) from producing an absurd log.
const MAX_STEPS: u32 = 1_000;

/// How the job ends when nothing cancels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
}

/// The simulated job described by a task's vars.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskBehaviour {
    pub outcome: Outcome,
    pub duration: Duration,
    pub steps: u32,
    pub outputs: BTreeMap<String, String>,
}

impl TaskBehaviour {
    /// Reads the `JR_FAKE_*` vars; missing ones take their defaults. A malformed value is an
    /// error naming the variable (the executor then fails the task, as a broken job would).
    pub fn from_vars(vars: &BTreeMap<String, String>) -> Result<TaskBehaviour, String> {
        let outcome = match vars.get(VAR_OUTCOME).map(|v| v.trim()) {
            None | Some("success") => Outcome::Success,
            Some("failure") => Outcome::Failure,
            Some(other) => {
                return Err(format!(
                    "{VAR_OUTCOME}={other:?}: expected success or failure"
                ));
            }
        };
        let duration_ms = match vars.get(VAR_DURATION_MS) {
            None => DEFAULT_DURATION_MS,
            Some(v) => v
                .trim()
                .parse::<u64>()
                .map_err(|e| format!("{VAR_DURATION_MS}={v:?}: {e}"))?,
        };
        let steps = match vars.get(VAR_STEPS) {
            None => DEFAULT_STEPS,
            Some(v) => v
                .trim()
                .parse::<u32>()
                .map_err(|e| format!("{VAR_STEPS}={v:?}: {e}"))?,
        };
        if steps > MAX_STEPS {
            return Err(format!("{VAR_STEPS}={steps}: at most {MAX_STEPS}"));
        }
        let outputs = match vars.get(VAR_OUTPUTS) {
            None => BTreeMap::new(),
            Some(v) => parse_outputs(v)?,
        };
        Ok(TaskBehaviour {
            outcome,
            duration: Duration::from_millis(duration_ms),
            steps,
            outputs,
        })
    }

    /// Simulated work per step (the whole duration when there are no steps is simply skipped).
    pub fn step_duration(&self) -> Duration {
        if self.steps == 0 {
            Duration::ZERO
        } else {
            self.duration / self.steps
        }
    }
}

fn parse_outputs(list: &str) -> Result<BTreeMap<String, String>, String> {
    let mut outputs = BTreeMap::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!("{VAR_OUTPUTS}: {item:?} is not k=v"));
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(format!("{VAR_OUTPUTS}: {item:?} has an empty key"));
        }
        outputs.insert(key.to_owned(), value.trim().to_owned());
    }
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn missing_vars_take_the_defaults() {
        let b = TaskBehaviour::from_vars(&BTreeMap::new()).expect("defaults");
        assert_eq!(b.outcome, Outcome::Success);
        assert_eq!(b.duration, Duration::from_millis(100));
        assert_eq!(b.steps, 2);
        assert!(b.outputs.is_empty());
        assert_eq!(b.step_duration(), Duration::from_millis(50));
    }

    #[test]
    fn all_vars_are_read() {
        let b = TaskBehaviour::from_vars(&vars(&[
            (VAR_OUTCOME, "failure"),
            (VAR_DURATION_MS, "900"),
            (VAR_STEPS, "3"),
            (VAR_OUTPUTS, "a=1, b = x=y ,"),
        ]))
        .expect("valid");
        assert_eq!(b.outcome, Outcome::Failure);
        assert_eq!(b.step_duration(), Duration::from_millis(300));
        assert_eq!(b.outputs, vars(&[("a", "1"), ("b", "x=y")]));
    }

    #[test]
    fn malformed_values_name_the_variable() {
        for (var, value) in [
            (VAR_OUTCOME, "maybe"),
            (VAR_DURATION_MS, "-1"),
            (VAR_STEPS, "two"),
            (VAR_STEPS, "5000"),
            (VAR_OUTPUTS, "novalue"),
            (VAR_OUTPUTS, "=1"),
        ] {
            let err = TaskBehaviour::from_vars(&vars(&[(var, value)])).expect_err(value);
            assert!(err.contains(var), "{err}");
        }
    }

    #[test]
    fn zero_steps_means_zero_step_duration() {
        let b = TaskBehaviour::from_vars(&vars(&[(VAR_STEPS, "0")])).expect("valid");
        assert_eq!(b.step_duration(), Duration::ZERO);
    }
}
