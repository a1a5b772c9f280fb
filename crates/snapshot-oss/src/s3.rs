//! [`S3Config`]: how to reach an S3 bucket, from code or from the environment (feature `aws`).

use std::fmt;
use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, S3ConditionalPut};
use object_store::{BackoffConfig, ClientConfigKey, RetryConfig};
use sandbox_core::{Error, Result};

use crate::options::{OssOptions, Secret};
use crate::store::OssSnapshotStore;

/// The variable naming the bucket (else `AWS_BUCKET` / `AWS_BUCKET_NAME`).
pub const BUCKET_VAR: &str = "SANDBOX_S3_BUCKET";
/// The variable naming the key prefix under which snapshots are kept (default: none).
pub const PREFIX_VAR: &str = "SANDBOX_S3_PREFIX";

/// Where an S3 bucket is and how to sign requests to it.
///
/// Built from code ([`S3Config::new`] and the setters), from the usual `AWS_*` variables
/// ([`S3Config::from_env`]), or for Alibaba Cloud OSS through its S3-compatible endpoint
/// ([`S3Config::alibaba`], [`S3Config::alibaba_from_env`]). Setters override what the
/// environment gave. `Debug` never shows the secret key or the session token.
#[derive(Clone)]
pub struct S3Config {
    from_env: bool,
    bucket: Option<String>,
    prefix: String,
    endpoint: Option<String>,
    region: Option<String>,
    access_key_id: Option<String>,
    secret_access_key: Option<Secret>,
    session_token: Option<Secret>,
    allow_http: Option<bool>,
    virtual_hosted_style: Option<bool>,
    conditional_put: bool,
    options: OssOptions,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("from_env", &self.from_env)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field(
                "endpoint",
                &self.endpoint.as_deref().map(sandbox_core::RedactedUrl),
            )
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &self.secret_access_key)
            .field("session_token", &self.session_token)
            .field("allow_http", &self.allow_http)
            .field("virtual_hosted_style", &self.virtual_hosted_style)
            .field("conditional_put", &self.conditional_put)
            .field("options", &self.options)
            .finish()
    }
}

impl S3Config {
    /// `bucket` on AWS S3, nothing taken from the environment: set the region and the
    /// credentials (or an endpoint) yourself.
    pub fn new(bucket: impl Into<String>) -> S3Config {
        S3Config {
            from_env: false,
            bucket: Some(bucket.into()),
            prefix: String::new(),
            endpoint: None,
            region: None,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            allow_http: None,
            virtual_hosted_style: None,
            conditional_put: true,
            options: OssOptions::default(),
        }
    }

    /// Everything `object_store` reads from `AWS_*` variables (`AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` / `AWS_DEFAULT_REGION`,
    /// `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, `AWS_VIRTUAL_HOSTED_STYLE_REQUEST`, `AWS_BUCKET`,
    /// web-identity and container credentials, ...), read when the store is built; the bucket
    /// from [`BUCKET_VAR`] if set, the key prefix from [`PREFIX_VAR`].
    pub fn from_env() -> S3Config {
        S3Config {
            from_env: true,
            bucket: non_empty_var(BUCKET_VAR),
            prefix: non_empty_var(PREFIX_VAR).unwrap_or_default(),
            ..S3Config::new("")
        }
        .unset_bucket_if_empty()
    }

    /// Alibaba Cloud OSS through its S3-compatible endpoint
    /// `https://s3.oss-<region>.aliyuncs.com` (`region` as `cn-hangzhou`), with
    /// virtual-hosted-style requests (OSS refuses path-style ones) and conditional puts off
    /// (`put_if_absent` is then `NotSupported`). Set the credentials (an AccessKey pair of a
    /// RAM user with OSS permissions) with [`credentials`](Self::credentials); for the internal
    /// endpoint use [`endpoint`](Self::endpoint)
    /// (`https://s3.oss-<region>-internal.aliyuncs.com`).
    pub fn alibaba(region: &str, bucket: impl Into<String>) -> S3Config {
        S3Config::new(bucket)
            .region(region)
            .endpoint(format!("https://s3.oss-{region}.aliyuncs.com"))
            .virtual_hosted_style(true)
            .conditional_put(false)
    }

    /// [`alibaba`](Self::alibaba) from Alibaba's usual variables: `OSS_ACCESS_KEY_ID`,
    /// `OSS_ACCESS_KEY_SECRET`, `OSS_SESSION_TOKEN` (STS, optional), `OSS_REGION`,
    /// `OSS_BUCKET`, `OSS_ENDPOINT` (optional, an S3-compatible endpoint) and [`PREFIX_VAR`].
    pub fn alibaba_from_env() -> Result<S3Config> {
        let need = |name: &str| {
            non_empty_var(name).ok_or_else(|| {
                Error::invalid("alibaba oss configuration", format!("{name} is not set"))
            })
        };
        let region = need("OSS_REGION")?;
        let mut config = S3Config::alibaba(&region, need("OSS_BUCKET")?)
            .credentials(need("OSS_ACCESS_KEY_ID")?, need("OSS_ACCESS_KEY_SECRET")?);
        if let Some(token) = non_empty_var("OSS_SESSION_TOKEN") {
            config = config.session_token(token);
        }
        if let Some(endpoint) = non_empty_var("OSS_ENDPOINT") {
            config = config.endpoint(endpoint);
        }
        if let Some(prefix) = non_empty_var(PREFIX_VAR) {
            config = config.prefix(prefix);
        }
        Ok(config)
    }

    fn unset_bucket_if_empty(mut self) -> Self {
        if self.bucket.as_deref() == Some("") {
            self.bucket = None;
        }
        self
    }

    /// The bucket.
    pub fn bucket(mut self, bucket: impl Into<String>) -> Self {
        self.bucket = Some(bucket.into());
        self
    }

    /// Keep every blob under `prefix/` in the bucket (segments of `[A-Za-z0-9._-]`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The service endpoint, without the bucket (`http://127.0.0.1:9000`,
    /// `https://s3.oss-cn-hangzhou.aliyuncs.com`). With virtual-hosted-style requests the
    /// bucket is put in front of its host name.
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// The region requests are signed for (`us-east-1`, `cn-hangzhou`).
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// Static credentials: an access key id and its secret.
    pub fn credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
    ) -> Self {
        self.access_key_id = Some(access_key_id.into());
        self.secret_access_key = Some(Secret(secret_access_key.into()));
        self
    }

    /// A session token that goes with temporary credentials.
    pub fn session_token(mut self, token: impl Into<String>) -> Self {
        self.session_token = Some(Secret(token.into()));
        self
    }

    /// Allow plain `http://` endpoints (a server on loopback or a private network only).
    pub fn allow_http(mut self, allow: bool) -> Self {
        self.allow_http = Some(allow);
        self
    }

    /// Virtual-hosted-style requests (`https://bucket.host/key`) instead of path-style ones
    /// (`https://host/bucket/key`, the default).
    pub fn virtual_hosted_style(mut self, on: bool) -> Self {
        self.virtual_hosted_style = Some(on);
        self
    }

    /// Whether the service honours `If-None-Match: *` on `PUT` (S3 since 2024, MinIO, R2,
    /// s3s): [`OssSnapshotStore::put_if_absent`] needs it. On by default.
    pub fn conditional_put(mut self, on: bool) -> Self {
        self.conditional_put = on;
        self
    }

    /// Upload, listing and time limits.
    pub fn options(mut self, options: OssOptions) -> Self {
        self.options = options;
        self
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The bucket, if known yet (the environment may still supply it).
    pub fn bucket_name(&self) -> Option<&str> {
        self.bucket.as_deref()
    }

    /// Build the store (no I/O: the first call connects).
    pub fn build(&self) -> Result<OssSnapshotStore> {
        self.options.check()?;
        let mut b = if self.from_env {
            AmazonS3Builder::from_env()
        } else {
            AmazonS3Builder::new()
        };
        if let Some(bucket) = &self.bucket {
            b = b.with_bucket_name(bucket);
        }
        let bucket = b
            .get_config_value(&AmazonS3ConfigKey::Bucket)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                Error::invalid(
                    "s3 configuration",
                    format!("no bucket: set it in code, or {BUCKET_VAR} or AWS_BUCKET"),
                )
            })?;
        if let Some(region) = &self.region {
            b = b.with_region(region);
        }
        if let Some(id) = &self.access_key_id {
            b = b.with_access_key_id(id);
        }
        if let Some(secret) = &self.secret_access_key {
            b = b.with_secret_access_key(&secret.0);
        }
        if let Some(token) = &self.session_token {
            b = b.with_token(&token.0);
        }
        if let Some(on) = self.virtual_hosted_style {
            b = b.with_virtual_hosted_style_request(on);
        }
        let virtual_hosted = b
            .get_config_value(&AmazonS3ConfigKey::VirtualHostedStyleRequest)
            .is_some_and(|v| v == "true");
        if let Some(endpoint) = &self.endpoint {
            let endpoint = if virtual_hosted {
                bucket_host(endpoint, &bucket)?
            } else {
                endpoint.clone()
            };
            b = b.with_endpoint(endpoint);
        }
        let o = &self.options;
        // Through `with_config`, so that client settings from the environment (a proxy,
        // `AWS_ALLOW_HTTP`) are kept.
        for (key, limit) in [
            (ClientConfigKey::ConnectTimeout, o.connect_timeout),
            (ClientConfigKey::Timeout, o.request_timeout),
            (ClientConfigKey::ReadTimeout, o.read_timeout),
        ] {
            b = b.with_config(
                AmazonS3ConfigKey::Client(key),
                format!("{}ms", limit.as_millis()),
            );
        }
        if let Some(allow) = self.allow_http {
            b = b.with_allow_http(allow);
        }
        b = b.with_retry(RetryConfig {
            backoff: BackoffConfig {
                init_backoff: std::time::Duration::from_millis(100),
                max_backoff: std::time::Duration::from_secs(5),
                base: 2.0,
            },
            max_retries: o.max_retries,
            retry_timeout: o.retry_timeout,
        });
        if !self.conditional_put {
            b = b.with_conditional_put(S3ConditionalPut::Disabled);
        }
        let endpoint = b
            .get_config_value(&AmazonS3ConfigKey::Endpoint)
            .unwrap_or_else(|| "aws".to_owned());
        // Requests are signed with the access key; user info in the endpoint (set in code or
        // by `AWS_ENDPOINT`) would only travel in URLs that the HTTP stack logs and errors quote.
        if sandbox_core::raw_userinfo(&endpoint).is_some() {
            return Err(Error::invalid(
                "s3 endpoint",
                format!(
                    "`{}` carries user info; S3 credentials go in `credentials` (or \
                     AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
                    sandbox_core::redact_url(&endpoint)
                ),
            ));
        }
        let s3 = b.build().map_err(|e| {
            // The builder's messages name keys and values it could not parse: never a secret,
            // but scrub anyway.
            Error::invalid("s3 configuration", self.scrub(&e.to_string()))
        })?;
        let s3 = Arc::new(s3);
        let store = OssSnapshotStore::from_paginated(s3, &self.prefix)?
            .with_service(format!("s3 bucket `{bucket}` at {endpoint}"))
            .with_options(self.options.clone())?
            .with_secrets(self.secrets());
        Ok(store)
    }

    fn secrets(&self) -> Vec<String> {
        let mut out: Vec<String> = [&self.secret_access_key, &self.session_token]
            .into_iter()
            .flatten()
            .map(|s| s.0.clone())
            .collect();
        if self.from_env {
            for name in ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"] {
                out.extend(non_empty_var(name));
            }
        }
        out.retain(|s| !s.is_empty());
        out
    }

    fn scrub(&self, text: &str) -> String {
        self.secrets()
            .iter()
            .fold(text.to_owned(), |t, s| t.replace(s.as_str(), "***"))
    }
}

fn non_empty_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `scheme://host…` → `scheme://bucket.host…`.
fn bucket_host(endpoint: &str, bucket: &str) -> Result<String> {
    let (scheme, rest) = endpoint.split_once("://").ok_or_else(|| {
        Error::invalid(
            "s3 endpoint",
            format!(
                "`{}` is not a URL (http[s]://host[:port])",
                sandbox_core::redact_url(endpoint)
            ),
        )
    })?;
    if rest.starts_with(&format!("{bucket}.")) {
        return Ok(endpoint.to_owned());
    }
    Ok(format!("{scheme}://{bucket}.{rest}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_secrets() {
        let c = S3Config::new("b")
            .credentials("AKIDEXAMPLE", "very-secret-key")
            .session_token("session-secret");
        let shown = format!("{c:?}");
        assert!(shown.contains("AKIDEXAMPLE"), "{shown}");
        assert!(!shown.contains("very-secret-key"), "{shown}");
        assert!(!shown.contains("session-secret"), "{shown}");
    }

    #[test]
    fn virtual_hosted_endpoints_name_the_bucket() {
        assert_eq!(
            bucket_host("https://s3.oss-cn-hangzhou.aliyuncs.com", "snaps").unwrap(),
            "https://snaps.s3.oss-cn-hangzhou.aliyuncs.com"
        );
        assert_eq!(
            bucket_host("https://snaps.example.com", "snaps").unwrap(),
            "https://snaps.example.com"
        );
        assert!(bucket_host("example.com", "b").is_err());
    }

    #[test]
    fn alibaba_preset() {
        let c = S3Config::alibaba("cn-hangzhou", "snaps");
        assert_eq!(
            c.endpoint.as_deref(),
            Some("https://s3.oss-cn-hangzhou.aliyuncs.com")
        );
        assert_eq!(c.virtual_hosted_style, Some(true));
        assert!(!c.conditional_put);
        let store = c
            .credentials("id", "secret")
            .build()
            .expect("builds offline");
        assert_eq!(store.reach(), sandbox_core::Reach::Cluster);
    }

    #[test]
    fn a_bucket_is_required() {
        let err = S3Config::new("").build().unwrap_err();
        assert!(err.to_string().contains("no bucket"), "{err}");
    }

    use sandbox_core::SnapshotStore as _;
}
