//! # The executor Pod
//!
//! One Pod per assignment attempt runs one job. `k8s/executor-pod-template.yaml` shows a complete
//! example of what is submitted.
//!
//! ## Names and labels
//!
//! The Pod and its Secret are both named `jr-<assignment uuid>-<attempt>`
//! ([`jr_worker::workload_name`]), so a redelivered assignment finds the existing Pod instead of
//! creating a second one. Labels (the first two form the selector the worker lists and watches):
//!
//! | label | value |
//! |---|---|
//! | `app.kubernetes.io/managed-by` | `jetrunner` |
//! | `jetrunner.dev/backend` | backend name, e.g. `pod` |
//! | `jetrunner.dev/assignment` | assignment UUID |
//! | `jetrunner.dev/attempt` | attempt number (1, 2, …) |
//! | `jetrunner.dev/worker` | id of the worker process that created it (sanitised to a label value) |
//! | `jetrunner.dev/provider` | provider name, when the assignment has one |
//!
//! The annotation `jetrunner.dev/runs-on` lists the job's `runs-on` labels.
//!
//! ## Executor environment (docs/architecture.md, "Executor contract")
//!
//! `JETRUNNER_FACADE_URL` and `JETRUNNER_ASSIGNMENT_ID` are plain env values.
//! `JETRUNNER_RUNNER_TOKEN` comes from `valueFrom.secretKeyRef` (key `runner-token`) of the
//! per-Pod Secret, so the token never appears in the Pod spec: anyone allowed to `get pods` (or
//! reading events/audit logs of Pod creation) does not see it. The Secret is created first; once
//! the Pod exists it gets an `ownerReference` to the Pod, so Kubernetes garbage-collects it with
//! the Pod. `delete` removes both explicitly anyway.
//!
//! ## Pod spec
//!
//! - `restartPolicy: Never` — a one-shot executor must not run twice.
//! - `activeDeadlineSeconds` = the assignment's `max_duration` — a backstop for wedged executors;
//!   the Pod then fails with reason `deadline-exceeded`.
//! - `automountServiceAccountToken: false` unless the runner block names a `service_account_name`
//!   (a job should not get Kubernetes API credentials by accident); `enableServiceLinks: false`.
//! - one container, `executor`, from the runner block's `image`/`command`/`args`/`env`/`resources`/
//!   `security_context`.
//!
//! ## The runner block
//!
//! Layered: the backend's block (`backend.<name>.runner`), then the provider's
//! (`backend.<name>.providers[].runner`). A later scalar replaces, mappings merge key by key,
//! lists replace whole, and `null` — or, since TOML has no null, an empty string or empty table —
//! clears a key (an empty list replaces whole, leaving nothing). An empty string for
//! `runtime_class_name`/`service_account_name` means unset.
//! Keys (unknown keys are refused, with the key's path in the error):
//!
//! | key | type | Pod field |
//! |---|---|---|
//! | `image` (required) | string | `containers[0].image` |
//! | `command`, `args` | list of strings | `containers[0].command` / `.args` |
//! | `env` | map string → string (`JETRUNNER_*` reserved) | `containers[0].env` |
//! | `resources` | Kubernetes `ResourceRequirements` (numbers allowed as quantities) | `containers[0].resources` |
//! | `security_context` | Kubernetes `SecurityContext` | `containers[0].securityContext` |
//! | `pod_security_context` | Kubernetes `PodSecurityContext` | `securityContext` |
//! | `runtime_class_name` | string | `runtimeClassName` |
//! | `node_selector` | map string → string | `nodeSelector` |
//! | `tolerations` | list of Kubernetes `Toleration` | `tolerations` |
//! | `service_account_name` | string | `serviceAccountName` |
//! | `image_pull_secrets` | list of Secret names | `imagePullSecrets` |
//! | `labels`, `annotations` | map string → string (`jetrunner.dev/*` reserved) | metadata |
//!
//! Values that are Kubernetes objects use the Kubernetes API spelling (`runAsNonRoot`).
//!
//! ## Phases and reasons reported
//!
//! `Pending`/`Running`/`Succeeded`/`Failed` from `status.phase`; `Terminating` once
//! `deletionTimestamp` is set; `Gone` when the Pod is deleted. Reasons: `evicted`, `oom-killed`,
//! `image-pull-failed`, `config-error` (e.g. the Secret is missing), `start-failed`,
//! `unschedulable`, `deadline-exceeded`; none for an ordinary exit.
//!
//! ## Known limitation: redelivery after the Pod was created
//!
//! The worker core mints a new token per delivery. If the Pod of an attempt already exists,
//! `create` returns it unchanged: the Pod's Secret still holds the token of the delivery that
//! created it. The Secret is only updated when the Pod does not exist yet (no executor has read
//! it). See the crate report for the options.
