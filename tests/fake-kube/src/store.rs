//! The object store of the fake API server: Pods and Secrets as JSON, one global resourceVersion,
//! and an event log that watches replay from.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde_json::{Map, Value, json};

/// The label every jetrunner Pod carries; Pods with it are counted in [`crate::Records`].
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY_VALUE: &str = "jetrunner";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    Pods,
    Secrets,
}

impl Resource {
    pub fn from_path(segment: &str) -> Option<Self> {
        match segment {
            "pods" => Some(Resource::Pods),
            "secrets" => Some(Resource::Secrets),
            _ => None,
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::Secrets => "Secret",
        }
    }

    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::Secrets => "secrets",
        }
    }
}

/// An API error, rendered as a Kubernetes `Status` body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub kind: Option<&'static str>,
    pub name: Option<String>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            kind: None,
            name: None,
        }
    }

    fn for_object(mut self, resource: Resource, name: &str) -> Self {
        self.kind = Some(resource.plural());
        self.name = Some(name.to_owned());
        self
    }

    pub fn not_found(resource: Resource, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", resource.plural()),
        )
        .for_object(resource, name)
    }

    pub fn already_exists(resource: Resource, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", resource.plural()),
        )
        .for_object(resource, name)
    }

    pub fn invalid(resource: Resource, name: &str, message: impl Into<String>) -> Self {
        let message = format!(
            "{} \"{name}\" is invalid: {}",
            resource.kind(),
            message.into()
        );
        Self::new(422, "Invalid", message).for_object(resource, name)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn unavailable() -> Self {
        Self::new(
            503,
            "ServiceUnavailable",
            "the fake API server is unavailable (injected outage)",
        )
    }

    pub fn status_json(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let (Some(kind), Some(name)) = (self.kind, &self.name) {
            status["details"] = json!({ "name": name, "kind": kind });
        }
        status
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

#[derive(Clone, Debug)]
pub struct StoredEvent {
    pub resource_version: u64,
    pub resource: Resource,
    pub namespace: String,
    pub event_type: EventType,
    pub object: Value,
}

/// An equality-based label selector (`a=b,c!=d,e,!f`).
#[derive(Clone, Debug, Default)]
pub struct LabelSelector {
    terms: Vec<SelectorTerm>,
}

#[derive(Clone, Debug)]
enum SelectorTerm {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
}

impl LabelSelector {
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        let mut terms = Vec::new();
        for raw in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if raw.contains(" in ") || raw.contains(" notin ") || raw.contains('(') {
                return Err(ApiError::bad_request(format!(
                    "set-based label selector {raw:?} is not supported by the fake API server"
                )));
            }
            let term = if let Some((k, v)) = raw.split_once("!=") {
                SelectorTerm::NotEquals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = raw.split_once("==") {
                SelectorTerm::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = raw.split_once('=') {
                SelectorTerm::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some(k) = raw.strip_prefix('!') {
                SelectorTerm::NotExists(k.trim().to_owned())
            } else {
                SelectorTerm::Exists(raw.to_owned())
            };
            terms.push(term);
        }
        Ok(Self { terms })
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = object
            .pointer("/metadata/labels")
            .and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.terms.iter().all(|term| match term {
            SelectorTerm::Equals(k, v) => get(k) == Some(v.as_str()),
            SelectorTerm::NotEquals(k, v) => get(k) != Some(v.as_str()),
            SelectorTerm::Exists(k) => get(k).is_some(),
            SelectorTerm::NotExists(k) => get(k).is_none(),
        })
    }
}

/// What the records count: every Pod carrying `app.kubernetes.io/managed-by=jetrunner`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Records {
    /// `namespace/name` of every jetrunner Pod ever created, in creation order (a name appearing
    /// twice means it was created twice).
    pub created: Vec<String>,
    /// jetrunner Pods that exist now (created and not yet removed; a terminating Pod still counts).
    pub live: usize,
    /// The largest `live` ever seen.
    pub max_live: usize,
    /// jetrunner Secrets that exist now (a token Secret outliving its Pod is a leak).
    pub secrets: usize,
}

type Key = (Resource, String, String);

#[derive(Default)]
pub struct Store {
    resource_version: u64,
    objects: BTreeMap<Key, Value>,
    events: Vec<StoredEvent>,
    records: Records,
    /// Keep at most this many events for watch replay (0: keep all). Like etcd compaction, a
    /// watch from an older resourceVersion is answered `410 Gone` and must relist.
    history_limit: usize,
    /// A ResourceQuota on `pods` per namespace: Pods not yet Succeeded or Failed count.
    pod_quotas: BTreeMap<String, usize>,
    /// Creates refused by a quota.
    pub quota_refusals: u64,
    /// The newest resourceVersion whose event was compacted away.
    compacted: u64,
}

/// The watch asked to resume from a resourceVersion that was compacted away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expired {
    pub oldest: u64,
}

pub fn is_jetrunner(object: &Value) -> bool {
    object.pointer(&format!(
        "/metadata/labels/{}",
        MANAGED_BY_LABEL.replace('/', "~1")
    )) == Some(&Value::String(MANAGED_BY_VALUE.to_owned()))
}

pub fn now_rfc3339() -> String {
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    time::OffsetDateTime::now_utc()
        .format(&format)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

fn is_dns_label(name: &str) -> bool {
    (1..=253).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(patch_map) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            if let Value::Object(target_map) = target {
                for (key, value) in patch_map {
                    if value.is_null() {
                        target_map.remove(key);
                    } else {
                        merge_patch(target_map.entry(key.clone()).or_insert(Value::Null), value);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

impl Store {
    /// Sets (or with `None` removes) the `pods` quota of a namespace.
    pub fn set_pod_quota(&mut self, namespace: &str, limit: Option<usize>) {
        match limit {
            Some(limit) => self.pod_quotas.insert(namespace.to_owned(), limit),
            None => self.pod_quotas.remove(namespace),
        };
    }

    pub fn resource_version(&self) -> u64 {
        self.resource_version
    }

    pub fn records(&self) -> Records {
        let mut records = self.records.clone();
        records.secrets = self
            .objects
            .iter()
            .filter(|((r, _, _), o)| *r == Resource::Secrets && is_jetrunner(o))
            .count();
        records
    }

    /// A store keeping at most `limit` events for watch replay (0: all).
    pub fn with_history_limit(limit: usize) -> Self {
        Self {
            history_limit: limit,
            ..Self::default()
        }
    }

    /// Drops the oldest events beyond the history limit.
    fn compact(&mut self) {
        if self.history_limit == 0 || self.events.len() <= self.history_limit {
            return;
        }
        let drop = self.events.len() - self.history_limit;
        if let Some(last) = self.events.get(drop - 1) {
            self.compacted = self.compacted.max(last.resource_version);
        }
        self.events.drain(..drop);
    }

    fn bump(&mut self) -> u64 {
        self.resource_version += 1;
        self.resource_version
    }

    fn record_event(
        &mut self,
        resource: Resource,
        namespace: &str,
        event_type: EventType,
        object: &Value,
    ) {
        self.events.push(StoredEvent {
            resource_version: self.resource_version,
            resource,
            namespace: namespace.to_owned(),
            event_type,
            object: object.clone(),
        });
        self.compact();
    }

    fn recount_live(&mut self) {
        let live = self
            .objects
            .iter()
            .filter(|((r, _, _), o)| *r == Resource::Pods && is_jetrunner(o))
            .count();
        self.records.live = live;
        self.records.max_live = self.records.max_live.max(live);
    }

    pub fn get(&self, resource: Resource, namespace: &str, name: &str) -> Result<Value, ApiError> {
        self.objects
            .get(&(resource, namespace.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(resource, name))
    }

    pub fn list(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        selector: &LabelSelector,
    ) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((r, ns, _), o)| {
                *r == resource && namespace.is_none_or(|want| want == ns) && selector.matches(o)
            })
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// One page of [`Store::list`]: at most `limit` objects (in namespace/name order) after the
    /// `after` position (namespace, name), and the position to continue from when more follow.
    pub fn list_page(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        selector: &LabelSelector,
        after: Option<&(String, String)>,
        limit: usize,
    ) -> (Vec<Value>, Option<(String, String)>) {
        let mut items = Vec::new();
        let mut last = None;
        for ((r, ns, name), o) in &self.objects {
            if *r != resource
                || namespace.is_some_and(|want| want != ns)
                || after.is_some_and(|(a_ns, a_name)| (ns, name) <= (a_ns, a_name))
                || !selector.matches(o)
            {
                continue;
            }
            if items.len() == limit {
                return (items, last);
            }
            items.push(o.clone());
            last = Some((ns.clone(), name.clone()));
        }
        (items, None)
    }

    /// The newest resourceVersion compacted away (a list continued from a snapshot older than
    /// this is refused with `410 Expired`, as the API server does).
    pub fn compacted(&self) -> u64 {
        self.compacted
    }

    /// Events after `resource_version`, oldest first; [`Expired`] when some of them were
    /// compacted away.
    pub fn events_after(&self, resource_version: u64) -> Result<&[StoredEvent], Expired> {
        if resource_version < self.compacted {
            return Err(Expired {
                oldest: self.compacted,
            });
        }
        let start = self
            .events
            .partition_point(|e| e.resource_version <= resource_version);
        Ok(&self.events[start..])
    }

    pub fn create(
        &mut self,
        resource: Resource,
        namespace: &str,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        if !object.is_object() {
            return Err(ApiError::bad_request(
                "the request body is not a JSON object",
            ));
        }
        let metadata = object
            .as_object_mut()
            .map(|o| o.entry("metadata").or_insert_with(|| json!({})))
            .ok_or_else(|| ApiError::bad_request("the request body is not a JSON object"))?;
        let mut name = metadata
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if name.is_empty()
            && let Some(prefix) = metadata.get("generateName").and_then(Value::as_str)
        {
            name = format!(
                "{prefix}{}",
                &uuid::Uuid::new_v4().simple().to_string()[..5]
            );
        }
        if let Some(ns) = metadata.get("namespace").and_then(Value::as_str)
            && ns != namespace
        {
            return Err(ApiError::bad_request(format!(
                "the namespace of the provided object ({ns}) does not match the namespace sent on the request ({namespace})"
            )));
        }
        if !is_dns_label(&name) {
            return Err(ApiError::invalid(
                resource,
                &name,
                "metadata.name: Invalid value: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'",
            ));
        }
        if resource == Resource::Pods {
            let containers = object.pointer("/spec/containers").and_then(Value::as_array);
            if containers.is_none_or(|c| c.is_empty()) {
                return Err(ApiError::invalid(
                    resource,
                    &name,
                    "spec.containers: Required value",
                ));
            }
        }
        let key = (resource, namespace.to_owned(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(resource, &name));
        }
        if resource == Resource::Pods
            && let Some(&limit) = self.pod_quotas.get(namespace)
        {
            let used = self
                .objects
                .iter()
                .filter(|((r, ns, _), pod)| {
                    *r == Resource::Pods
                        && ns == namespace
                        && !matches!(
                            pod.pointer("/status/phase").and_then(Value::as_str),
                            Some("Succeeded" | "Failed")
                        )
                })
                .count();
            if used >= limit {
                self.quota_refusals += 1;
                return Err(ApiError::new(
                    403,
                    "Forbidden",
                    format!(
                        "pods \"{name}\" is forbidden: exceeded quota: jetrunner-quota, requested: pods=1, used: pods={used}, limited: pods={limit}"
                    ),
                ));
            }
        }
        let rv = self.bump();
        object["apiVersion"] = json!("v1");
        object["kind"] = json!(resource.kind());
        let meta = &mut object["metadata"];
        meta["name"] = json!(name);
        meta["namespace"] = json!(namespace);
        meta["uid"] = json!(uuid::Uuid::new_v4().to_string());
        meta["resourceVersion"] = json!(rv.to_string());
        meta["creationTimestamp"] = json!(now_rfc3339());
        if let Some(m) = meta.as_object_mut() {
            m.remove("deletionTimestamp");
            m.remove("generateName");
        }
        match resource {
            Resource::Pods => {
                object["status"] = json!({ "phase": "Pending", "qosClass": "BestEffort" });
            }
            Resource::Secrets => normalise_secret(&mut object),
        }
        self.objects.insert(key, object.clone());
        self.record_event(resource, namespace, EventType::Added, &object);
        if resource == Resource::Pods && is_jetrunner(&object) {
            self.records.created.push(format!("{namespace}/{name}"));
            self.recount_live();
        }
        Ok(object)
    }

    /// Stores a modified object: checks an optimistic-concurrency resourceVersion if `expected` is
    /// given, bumps the version and records a MODIFIED event.
    fn store_modified(
        &mut self,
        key: Key,
        mut object: Value,
        expected: Option<&str>,
    ) -> Result<Value, ApiError> {
        let current = self
            .objects
            .get(&key)
            .ok_or_else(|| ApiError::not_found(key.0, &key.2))?;
        if let Some(expected) = expected
            && current
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str)
                != Some(expected)
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{}\": the object has been modified; please apply your changes to the latest version and try again",
                    key.0.plural(),
                    key.2
                ),
            )
            .for_object(key.0, &key.2));
        }
        // Immutable fields keep their stored values.
        for field in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
        ] {
            match current["metadata"].get(field) {
                Some(v) => object["metadata"][field] = v.clone(),
                None => {
                    if let Some(m) = object["metadata"].as_object_mut() {
                        m.remove(field);
                    }
                }
            }
        }
        object["apiVersion"] = json!("v1");
        object["kind"] = json!(key.0.kind());
        if key.0 == Resource::Secrets {
            normalise_secret(&mut object);
        }
        let rv = self.bump();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.objects.insert(key.clone(), object.clone());
        self.record_event(key.0, &key.1, EventType::Modified, &object);
        Ok(object)
    }

    pub fn replace(
        &mut self,
        resource: Resource,
        namespace: &str,
        name: &str,
        object: Value,
    ) -> Result<Value, ApiError> {
        if object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .is_some_and(|n| n != name)
        {
            return Err(ApiError::bad_request(
                "the name of the object does not match the name on the URL",
            ));
        }
        let expected = object
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let mut object = object;
        if resource == Resource::Pods {
            // Status is a subresource: a PUT on the object keeps the stored status.
            let current = self.get(resource, namespace, name)?;
            object["status"] = current["status"].clone();
        }
        self.store_modified(
            (resource, namespace.to_owned(), name.to_owned()),
            object,
            expected.as_deref(),
        )
    }

    pub fn patch(
        &mut self,
        resource: Resource,
        namespace: &str,
        name: &str,
        patch: &Value,
    ) -> Result<Value, ApiError> {
        let mut object = self.get(resource, namespace, name)?;
        let expected = patch
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_owned);
        merge_patch(&mut object, patch);
        self.store_modified(
            (resource, namespace.to_owned(), name.to_owned()),
            object,
            expected.as_deref(),
        )
    }

    /// Changes a Pod's status in place (what the kubelet does). `None` if the Pod is gone or
    /// terminating (the kubelet stopped caring about it).
    pub fn update_pod_status(
        &mut self,
        namespace: &str,
        name: &str,
        update: impl FnOnce(&mut Value),
    ) -> Option<Value> {
        let key = (Resource::Pods, namespace.to_owned(), name.to_owned());
        let mut object = self.objects.get(&key)?.clone();
        if object.pointer("/metadata/deletionTimestamp").is_some() {
            return None;
        }
        update(&mut object["status"]);
        self.store_modified(key, object, None).ok()
    }

    /// Marks a Pod as terminating (graceful deletion).
    pub fn mark_deleting(&mut self, namespace: &str, name: &str) -> Result<Value, ApiError> {
        let key = (Resource::Pods, namespace.to_owned(), name.to_owned());
        let mut object = self.get(Resource::Pods, namespace, name)?;
        if object.pointer("/metadata/deletionTimestamp").is_some() {
            return Ok(object);
        }
        let rv = self.bump();
        object["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        object["metadata"]["deletionGracePeriodSeconds"] = json!(30);
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.objects.insert(key, object.clone());
        self.record_event(Resource::Pods, namespace, EventType::Modified, &object);
        Ok(object)
    }

    /// Removes an object now, plus (garbage collection) every object in the namespace that names
    /// it as owner. Returns the removed object.
    pub fn remove(
        &mut self,
        resource: Resource,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let key = (resource, namespace.to_owned(), name.to_owned());
        let mut object = self
            .objects
            .remove(&key)
            .ok_or_else(|| ApiError::not_found(resource, name))?;
        let rv = self.bump();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.record_event(resource, namespace, EventType::Deleted, &object);
        let uid = object
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let owned: Vec<Key> = self
            .objects
            .iter()
            .filter(|((_, ns, _), o)| {
                ns == namespace
                    && o.pointer("/metadata/ownerReferences")
                        .and_then(Value::as_array)
                        .is_some_and(|refs| {
                            refs.iter().any(|r| r["uid"].as_str() == Some(uid.as_str()))
                        })
            })
            .map(|(k, _)| k.clone())
            .collect();
        for (r, ns, n) in owned {
            // Owned objects are removed by the same cascade; errors cannot happen (they exist).
            let _ = self.remove(r, &ns, &n);
        }
        if resource == Resource::Pods {
            self.recount_live();
        }
        Ok(object)
    }
}

/// The API server turns `stringData` into base64 `data` on write.
fn normalise_secret(object: &mut Value) {
    let Some(map) = object.as_object_mut() else {
        return;
    };
    if let Some(Value::Object(string_data)) = map.remove("stringData") {
        let data = map.entry("data").or_insert_with(|| json!({}));
        for (k, v) in string_data {
            let encoded =
                base64::engine::general_purpose::STANDARD.encode(v.as_str().unwrap_or_default());
            data[k] = Value::String(encoded);
        }
    }
    map.entry("type").or_insert_with(|| json!("Opaque"));
}

/// The decoded value of `key` in a Secret object.
pub fn secret_value(secret: &Value, key: &str) -> Option<String> {
    let encoded = secret.pointer("/data")?.get(key)?.as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selector_supports_equality_inequality_and_existence() {
        let pod = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        let matches = |s: &str| {
            LabelSelector::parse(s)
                .expect("valid selector")
                .matches(&pod)
        };
        assert!(matches("a=1,b==2"));
        assert!(matches("a!=2,b"));
        assert!(matches("!c"));
        assert!(!matches("a=1,b=3"));
        assert!(!matches("c"));
        assert!(LabelSelector::parse("a in (1,2)").is_err());
    }

    #[test]
    fn deleting_an_owner_removes_owned_secrets_and_records_events() {
        let mut store = Store::default();
        let pod = store
            .create(Resource::Pods, "ns", json!({"metadata": {"name": "p", "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE}}, "spec": {"containers": [{"name": "c"}]}}))
            .expect("create pod");
        let uid = pod["metadata"]["uid"].clone();
        store
            .create(Resource::Secrets, "ns", json!({"metadata": {"name": "p", "ownerReferences": [{"uid": uid}]}, "stringData": {"k": "v"}}))
            .expect("create secret");
        assert_eq!(
            secret_value(
                &store.get(Resource::Secrets, "ns", "p").expect("secret"),
                "k"
            )
            .as_deref(),
            Some("v")
        );
        let before = store.resource_version();
        store.remove(Resource::Pods, "ns", "p").expect("remove");
        assert!(store.get(Resource::Secrets, "ns", "p").is_err());
        let kinds: Vec<_> = store
            .events_after(before)
            .expect("not compacted")
            .iter()
            .map(|e| (e.resource, e.event_type))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (Resource::Pods, EventType::Deleted),
                (Resource::Secrets, EventType::Deleted)
            ]
        );
        assert_eq!(store.records().max_live, 1);
        assert_eq!(store.records().live, 0);
    }

    #[test]
    fn merge_patch_replaces_lists_and_null_removes() {
        let mut target = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        merge_patch(&mut target, &json!({"a": {"b": null, "d": 3}, "l": [3]}));
        assert_eq!(target, json!({"a": {"c": 2, "d": 3}, "l": [3]}));
    }

    #[test]
    fn compacted_history_answers_expired_for_older_versions() {
        let mut store = Store::with_history_limit(2);
        let start = store.resource_version();
        for name in ["a", "b", "c"] {
            store
                .create(Resource::Secrets, "ns", json!({"metadata": {"name": name}}))
                .expect("create");
        }
        assert_eq!(
            store.events_after(start).map(<[StoredEvent]>::len),
            Err(Expired { oldest: start + 1 })
        );
        let kept = store.events_after(start + 1).expect("still replayable");
        assert_eq!(kept.len(), 2);
    }
}
