//! The agent-sandbox resources this backend touches, as `DynamicObject`s: their API
//! resources, the claim it creates, and what it reads from claims, Sandboxes and Gateways.

use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use sandbox_core::{Error, Result};
use serde_json::{Value, json};

use crate::BACKEND;

/// `extensions.agents.x-k8s.io/v1beta1` `SandboxClaim`.
pub(crate) fn claim_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("extensions.agents.x-k8s.io", "v1beta1", "SandboxClaim"),
        "sandboxclaims",
    )
}

/// `agents.x-k8s.io/v1beta1` `Sandbox`.
pub(crate) fn sandbox_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("agents.x-k8s.io", "v1beta1", "Sandbox"),
        "sandboxes",
    )
}

/// `gateway.networking.k8s.io/v1` `Gateway`.
pub(crate) fn gateway_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "Gateway"),
        "gateways",
    )
}

/// Annotation naming the pod when it differs from the Sandbox (warm-pool adoption).
pub(crate) const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";
/// Claim annotation naming an adopted warm-pool Sandbox.
pub(crate) const SANDBOX_NAME_ANNOTATION: &str = "agents.x-k8s.io/sandbox-name";

/// Ready=False reasons after which a claim never becomes Ready (the official SDK fails fast
/// on the same list), and the pod reasons that end a Sandbox.
const TERMINAL: &[&str] = &[
    "InvalidMetadata",
    "EnvVarsInjectionRejected",
    "VolumeClaimTemplatesError",
    "ClaimExpired",
    "SandboxExpired",
    "PodFailed",
    "PodSucceeded",
];

/// The spec of a new claim.
pub(crate) fn claim_spec(warm_pool: &str, shutdown_time: &str) -> Value {
    json!({
        "spec": {
            "warmPoolRef": { "name": warm_pool },
            "lifecycle": { "shutdownTime": shutdown_time, "shutdownPolicy": "Delete" }
        }
    })
}

/// Where a claim stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClaimStatus {
    /// Ready and bound to this Sandbox.
    Bound(String),
    /// Not yet; the Ready condition's reason, if any.
    Pending(Option<String>),
    /// Never will be: the reason and message.
    Failed { reason: String, message: String },
}

fn ready_condition(status: Option<&Value>) -> Option<&Value> {
    status?
        .get("conditions")?
        .as_array()?
        .iter()
        .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
}

fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// Read a claim's Ready condition and binding.
pub(crate) fn claim_status(claim: &DynamicObject) -> ClaimStatus {
    let status = claim.data.get("status");
    let ready = ready_condition(status);
    let reason = ready.and_then(|c| str_at(c, "reason")).map(str::to_owned);
    if let Some(r) = &reason
        && ready.and_then(|c| str_at(c, "status")) != Some("True")
        && TERMINAL.contains(&r.as_str())
    {
        return ClaimStatus::Failed {
            reason: r.clone(),
            message: ready
                .and_then(|c| str_at(c, "message"))
                .unwrap_or_default()
                .to_owned(),
        };
    }
    if ready.and_then(|c| str_at(c, "status")) == Some("True") {
        let name = status
            .and_then(|s| s.pointer("/sandbox/name"))
            .and_then(Value::as_str)
            .or_else(|| {
                claim
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(SANDBOX_NAME_ANNOTATION))
                    .map(String::as_str)
            });
        if let Some(name) = name.filter(|n| !n.is_empty()) {
            return ClaimStatus::Bound(name.to_owned());
        }
    }
    ClaimStatus::Pending(reason)
}

/// The typed error of a claim that failed for good.
pub(crate) fn claim_failure(claim: &str, reason: &str, message: &str) -> Error {
    let what = format!("claim `{claim}`: {reason}: {message}");
    match reason {
        // The box is gone: a later call makes a new one and restores the workspace.
        "ClaimExpired" | "SandboxExpired" | "PodFailed" | "PodSucceeded" => Error::NotFound {
            what: "running sandbox pod",
            key: what,
        },
        _ => Error::InvalidInput {
            what: "sandbox claim",
            reason: what,
        },
    }
}

/// What the data plane needs of a bound Sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SandboxInfo {
    pub name: String,
    pub pod_ip: Option<String>,
    pub service_fqdn: Option<String>,
    pub pod_name: String,
    /// Ready=False with a terminal reason: the pod is gone.
    pub failed: Option<(String, String)>,
}

pub(crate) fn sandbox_info(sandbox: &DynamicObject) -> Result<SandboxInfo> {
    let name = sandbox
        .metadata
        .name
        .clone()
        .ok_or_else(|| Error::backend(BACKEND, "read sandbox", "a Sandbox without a name"))?;
    let status = sandbox.data.get("status");
    let pod_ip = status
        .and_then(|s| s.get("podIPs"))
        .and_then(Value::as_array)
        .and_then(|ips| ips.iter().filter_map(Value::as_str).next())
        .map(str::to_owned);
    let service_fqdn = status
        .and_then(|s| str_at(s, "serviceFQDN"))
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    let pod_name = sandbox
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_NAME_ANNOTATION))
        .cloned()
        .unwrap_or_else(|| name.clone());
    let ready = ready_condition(status);
    let failed = ready
        .filter(|c| str_at(c, "status") != Some("True"))
        .and_then(|c| str_at(c, "reason"))
        .filter(|r| TERMINAL.contains(r))
        .map(|r| {
            (
                r.to_owned(),
                ready
                    .and_then(|c| str_at(c, "message"))
                    .unwrap_or_default()
                    .to_owned(),
            )
        });
    Ok(SandboxInfo {
        name,
        pod_ip,
        service_fqdn,
        pod_name,
        failed,
    })
}

/// The first address of a Gateway's status.
pub(crate) fn gateway_address(gateway: &DynamicObject) -> Option<String> {
    gateway
        .data
        .pointer("/status/addresses")?
        .as_array()?
        .iter()
        .filter_map(|a| str_at(a, "value"))
        .find(|v| !v.is_empty())
        .map(str::to_owned)
}

/// RFC 3339 (UTC, seconds) of a Unix time, for `lifecycle.shutdownTime`.
pub(crate) fn rfc3339(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(status: Value) -> DynamicObject {
        let mut o = DynamicObject::new("c", &claim_resource());
        o.data = json!({ "status": status });
        o
    }

    #[test]
    fn claim_states() {
        assert_eq!(claim_status(&claim(json!({}))), ClaimStatus::Pending(None));
        let pending = claim(json!({"conditions": [
            {"type": "Ready", "status": "False", "reason": "SandboxNotReady"}]}));
        assert_eq!(
            claim_status(&pending),
            ClaimStatus::Pending(Some("SandboxNotReady".into()))
        );
        let ready_unbound = claim(json!({"conditions": [{"type": "Ready", "status": "True"}]}));
        assert_eq!(claim_status(&ready_unbound), ClaimStatus::Pending(None));
        let bound = claim(json!({"conditions": [{"type": "Ready", "status": "True",
            "reason": "DependenciesReady"}], "sandbox": {"name": "sb-1"}}));
        assert_eq!(claim_status(&bound), ClaimStatus::Bound("sb-1".into()));
        let failed = claim(json!({"conditions": [{"type": "Ready", "status": "False",
            "reason": "ClaimExpired", "message": "too old"}]}));
        assert_eq!(
            claim_status(&failed),
            ClaimStatus::Failed {
                reason: "ClaimExpired".into(),
                message: "too old".into()
            }
        );
        assert!(matches!(
            claim_failure("c", "ClaimExpired", ""),
            Error::NotFound { .. }
        ));
        assert!(matches!(
            claim_failure("c", "InvalidMetadata", ""),
            Error::InvalidInput { .. }
        ));
    }

    #[test]
    fn sandbox_fields() {
        let mut o = DynamicObject::new("sb", &sandbox_resource());
        o.data = json!({"status": {"podIPs": ["10.0.0.7"], "serviceFQDN": "sb.ns.svc.cluster.local",
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed"}]}});
        o.metadata.annotations =
            Some([(POD_NAME_ANNOTATION.to_owned(), "pool-x".to_owned())].into());
        let info = sandbox_info(&o).unwrap();
        assert_eq!(info.pod_ip.as_deref(), Some("10.0.0.7"));
        assert_eq!(info.pod_name, "pool-x");
        assert_eq!(
            info.failed.as_ref().map(|f| f.0.as_str()),
            Some("PodFailed")
        );
    }

    #[test]
    fn gateway_addresses() {
        let mut g = DynamicObject::new("gw", &gateway_resource());
        g.data = json!({"status": {"addresses": [{"type": "IPAddress", "value": "192.0.2.4"}]}});
        assert_eq!(gateway_address(&g).as_deref(), Some("192.0.2.4"));
        g.data = json!({"status": {}});
        assert_eq!(gateway_address(&g), None);
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_007_099), "2026-11-30T02:51:39Z");
    }
}
