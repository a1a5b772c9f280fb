//! Label and field selectors, as `kubectl` and the client libraries send them.

use serde_json::Value;

use crate::error::ApiError;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed `labelSelector` (equality- and set-based requirements, ANDed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelReq>);

/// The fields a `fieldSelector` may name on custom resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Name,
    Namespace,
}

/// A parsed `fieldSelector` (`metadata.name` and `metadata.namespace`; `=`, `==`, `!=`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(Field, bool, String)>);

/// Both selectors of a list or watch request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selectors {
    /// The label selector.
    pub labels: LabelSelector,
    /// The field selector.
    pub fields: FieldSelector,
}

impl Selectors {
    /// Whether `obj` matches both selectors.
    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }
}

/// Split on commas that are not inside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_set(key: &str, rest: &str, raw: &str) -> Result<(String, Vec<String>), ApiError> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| ApiError::bad_request(format!("invalid label selector `{raw}`")))?;
    let values = inner
        .split(',')
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect();
    Ok((key.trim().to_owned(), values))
}

impl LabelSelector {
    /// Parse a selector such as `app=x,tier!=db,env in (a,b),!legacy`.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let bad = || ApiError::bad_request(format!("invalid label selector `{part}`"));
            let req = if let Some((k, v)) = part.split_once("!=") {
                LabelReq::NotEq(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = part.split_once("==") {
                LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = part.split_once('=') {
                LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                let (k, vs) = parse_set(k, rest, part)?;
                LabelReq::NotIn(k, vs)
            } else if let Some((k, rest)) = part.split_once(" in ") {
                let (k, vs) = parse_set(k, rest, part)?;
                LabelReq::In(k, vs)
            } else if let Some(k) = part.strip_prefix('!') {
                LabelReq::NotExists(k.trim().to_owned())
            } else if part.contains(['(', ')', ' ', '<', '>']) {
                return Err(bad());
            } else {
                LabelReq::Exists(part.to_owned())
            };
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    /// Whether the object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
        })
    }
}

impl FieldSelector {
    /// Parse a selector such as `metadata.name=x`; other fields are a 400, as on a real
    /// API server for custom resources.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (k, eq, v) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid field selector `{part}`"
                )));
            };
            let field = match k.trim() {
                "metadata.name" => Field::Name,
                "metadata.namespace" => Field::Namespace,
                other => {
                    return Err(ApiError::bad_request(format!(
                        "field label not supported: {other}"
                    )));
                }
            };
            reqs.push((field, eq, v.trim().to_owned()));
        }
        Ok(Self(reqs))
    }

    /// Whether the object satisfies every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, eq, v)| {
            let path = match field {
                Field::Name => "/metadata/name",
                Field::Namespace => "/metadata/namespace",
            };
            let got = obj.pointer(path).and_then(Value::as_str).unwrap_or("");
            (got == v) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selectors_match_like_kubernetes() {
        let obj = json!({"metadata": {"labels": {"app": "web", "env": "prod"}}});
        let yes = [
            "app=web",
            "app==web,env",
            "env in (prod, dev)",
            "tier notin (db)",
            "!tier",
            "app!=db",
        ];
        let no = ["app=db", "env notin (prod)", "!app", "tier", "env in (dev)"];
        for s in yes {
            assert!(LabelSelector::parse(s).unwrap().matches(&obj), "{s}");
        }
        for s in no {
            assert!(!LabelSelector::parse(s).unwrap().matches(&obj), "{s}");
        }
        assert!(LabelSelector::parse("a in b").is_err());
    }

    #[test]
    fn field_selectors_know_name_and_namespace_only() {
        let obj = json!({"metadata": {"name": "x", "namespace": "ns"}});
        assert!(
            FieldSelector::parse("metadata.name=x")
                .unwrap()
                .matches(&obj)
        );
        assert!(
            FieldSelector::parse("metadata.namespace!=y")
                .unwrap()
                .matches(&obj)
        );
        assert!(
            !FieldSelector::parse("metadata.name==y")
                .unwrap()
                .matches(&obj)
        );
        assert!(FieldSelector::parse("spec.foo=x").is_err());
    }
}
