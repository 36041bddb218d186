//! `s3://bucket/prefix` store on any S3-compatible server (AWS S3, SeaweedFS, MinIO, ...)
//! through aws-sdk-s3.
//!
//! Configuration follows the standard AWS conventions: credentials from
//! `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` (+ `AWS_SESSION_TOKEN`) or a profile
//! (`AWS_PROFILE`, `~/.aws/credentials`); region from `AWS_REGION`/`AWS_DEFAULT_REGION` or
//! the profile (default `us-east-1`); endpoint from `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`.
//! The URL's query may override: `?endpoint=http://127.0.0.1:8333&region=r&path_style=true`.
//! Path-style addressing is on by default when a custom endpoint is set.
//!
//! The cloud instance-metadata credential and region lookups are deliberately not in the
//! chain: a store on a laptop or CI runner must fail fast with a clear message instead of
//! probing the network. Retries use the SDK's standard mode (exponential backoff with
//! jitter on throttling, 5xx and connection errors); every call has timeouts.

use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::meta::region::RegionProviderChain;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::BehaviorVersion;
use aws_credential_types::provider::ProvideCredentials;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use aws_sdk_s3::Client;
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use bytes::{Bytes, BytesMut};

use super::{check_key, check_prefix, MultipartUpload, ObjectMeta, ObjectStore, PutOutcome, Result, StoreError};

/// Part size of streaming uploads (S3's minimum is 5 MiB for all but the last part).
const PART_SIZE: usize = 8 * 1024 * 1024;

/// Settings of an S3 store, parsed from its URL and the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Options {
    pub bucket: String,
    /// Key prefix inside the bucket, without leading or trailing `/` (may be empty).
    pub prefix: String,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub path_style: Option<bool>,
}

impl S3Options {
    /// Parses `s3://bucket/prefix?endpoint=..&region=..&path_style=true`.
    pub fn parse(url: &str) -> Result<Self> {
        let invalid = |reason: String| StoreError::InvalidUrl { url: crate::redact_url(url), reason };
        // The URL parser resolves `..` (`s3://b/../../x` would become `s3://b/x`): a path
        // that climbs is refused as written.
        let path = url.split(['?', '#']).next().unwrap_or("");
        if let Some(rest) = path.strip_prefix("s3://") {
            let climbs = rest.split('/').skip(1).any(|seg| {
                let seg = seg.to_ascii_lowercase().replace("%2e", ".");
                seg == ".." || seg == "."
            });
            if climbs {
                return Err(invalid(
                    "`.` and `..` segments are not allowed in the prefix; write the key prefix itself (s3://bucket/runs/team)".into(),
                ));
            }
        }
        let parsed = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        if parsed.scheme() != "s3" {
            return Err(invalid("expected an s3:// URL".into()));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(invalid("credentials do not belong in the URL; use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE".into()));
        }
        let bucket = parsed.host_str().filter(|b| !b.is_empty()).ok_or_else(|| invalid("missing bucket name".into()))?;
        let prefix = parsed.path().trim_matches('/').to_string();
        let mut opts = S3Options { bucket: bucket.to_string(), prefix, endpoint: None, region: None, path_style: None };
        for (k, v) in parsed.query_pairs() {
            match k.as_ref() {
                "endpoint" => {
                    let ok = url::Url::parse(&v).is_ok_and(|e| matches!(e.scheme(), "http" | "https") && e.host_str().is_some());
                    if !ok {
                        return Err(invalid(format!(
                            "endpoint must be an http(s) URL such as http://127.0.0.1:8333, not `{}`",
                            crate::redact_url(&v)
                        )));
                    }
                    opts.endpoint = Some(v.to_string())
                }
                "region" => opts.region = Some(v.to_string()),
                "path_style" => {
                    opts.path_style = Some(match v.as_ref() {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        other => return Err(invalid(format!("path_style must be true or false, not `{other}`"))),
                    })
                }
                other => return Err(invalid(format!("unknown option `{other}`; known: endpoint, region, path_style"))),
            }
        }
        Ok(opts)
    }

    /// The URL [`S3Options::parse`] reads back as these options rooted at `prefix` below
    /// this prefix (endpoint, region and path style kept; an endpoint's credentials dropped).
    pub fn url_at(&self, prefix: &str) -> String {
        let path: Vec<&str> = [self.prefix.as_str(), prefix.trim_matches('/')].into_iter().filter(|p| !p.is_empty()).collect();
        let mut url = format!("s3://{}", self.bucket);
        if !path.is_empty() {
            url.push('/');
            url.push_str(&path.join("/"));
        }
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        if let Some(e) = &self.endpoint {
            // As given, unless it carries credentials (which never leave in a URL).
            let e = crate::redact_url(e);
            query.append_pair("endpoint", &e);
        }
        if let Some(r) = &self.region {
            query.append_pair("region", r);
        }
        if let Some(p) = self.path_style {
            query.append_pair("path_style", if p { "true" } else { "false" });
        }
        let query = query.finish();
        if !query.is_empty() {
            url.push('?');
            url.push_str(&query);
        }
        url
    }
}

/// An object store in an S3 bucket (optionally under a prefix).
#[derive(Debug, Clone)]
pub struct S3Store {
    client: Client,
    opts: S3Options,
    endpoint: String,
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl S3Store {
    /// Connects to the bucket a URL names. Fails fast, with the setting to fix, when no
    /// credentials can be found.
    pub async fn connect(url: &str) -> Result<Self> {
        let opts = S3Options::parse(url)?;
        Self::with_options(opts).await
    }

    pub async fn with_options(opts: S3Options) -> Result<Self> {
        let credentials = CredentialsProviderChain::first_try(
            "Environment",
            aws_config::environment::credentials::EnvironmentVariableCredentialsProvider::new(),
        )
        .or_else("Profile", aws_config::profile::ProfileFileCredentialsProvider::builder().build());
        let store_url = display_url(&opts);
        if let Err(e) = credentials.provide_credentials().await {
            return Err(StoreError::Credentials { context: format!("{store_url}: no AWS credentials found"), detail: e.to_string() });
        }
        let region = match &opts.region {
            Some(r) => aws_config::Region::new(r.clone()),
            None => RegionProviderChain::first_try(aws_config::environment::region::EnvironmentVariableRegionProvider::new())
                .or_else(aws_config::profile::ProfileFileRegionProvider::builder().build())
                .or_else(aws_config::Region::new("us-east-1"))
                .region()
                .await
                .unwrap_or_else(|| aws_config::Region::new("us-east-1")),
        };
        let endpoint = opts.endpoint.clone().or_else(|| env_nonempty("AWS_ENDPOINT_URL_S3")).or_else(|| env_nonempty("AWS_ENDPOINT_URL"));
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .credentials_provider(credentials)
            .region(region)
            .retry_config(RetryConfig::standard().with_max_attempts(4))
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(3))
                    .read_timeout(Duration::from_secs(60))
                    .operation_attempt_timeout(Duration::from_secs(120))
                    .build(),
            );
        if let Some(ep) = &endpoint {
            loader = loader.endpoint_url(ep);
        }
        let sdk = loader.load().await;
        let path_style = opts.path_style.unwrap_or(endpoint.is_some());
        let config = aws_sdk_s3::config::Builder::from(&sdk).force_path_style(path_style).build();
        // Printed in errors: an endpoint's credentials (from the URL or AWS_ENDPOINT_URL) never are.
        let shown = endpoint.as_deref().map(crate::redact_url).unwrap_or_else(|| "the AWS S3 endpoint".into());
        Ok(S3Store { client: Client::from_conf(config), endpoint: shown, opts })
    }

    fn full_key(&self, key: &str) -> Result<String> {
        check_key(key)?;
        Ok(if self.opts.prefix.is_empty() { key.to_string() } else { format!("{}/{key}", self.opts.prefix) })
    }

    fn strip(&self, full: &str) -> String {
        if self.opts.prefix.is_empty() {
            full.to_string()
        } else {
            full.strip_prefix(&self.opts.prefix).map(|k| k.trim_start_matches('/').to_string()).unwrap_or_default()
        }
    }

    /// The bytes of an object, or of the HTTP `Range` of it (`bytes=<first>-<last>`).
    async fn get_object(&self, key: &str, range: Option<String>) -> Result<Bytes> {
        let full = self.full_key(key)?;
        let request = self.client.get_object().bucket(&self.opts.bucket).key(full).set_range(range);
        let out = request.send().await.map_err(|e| self.map_err(key, e))?;
        let data = out
            .body
            .collect()
            .await
            .map_err(|e| StoreError::Backend { url: self.object_url(key), detail: format!("reading the body failed: {e}") })?;
        Ok(data.into_bytes())
    }

    /// Maps an SDK error to a typed store error that names the object, never credentials.
    fn map_err<E>(&self, key: &str, err: SdkError<E, HttpResponse>) -> StoreError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        map_sdk_error(&self.opts, &self.endpoint, &self.object_url(key), err)
    }
}

fn display_url(opts: &S3Options) -> String {
    if opts.prefix.is_empty() {
        format!("s3://{}", opts.bucket)
    } else {
        format!("s3://{}/{}", opts.bucket, opts.prefix)
    }
}

fn map_sdk_error<E>(opts: &S3Options, endpoint: &str, url: &str, err: SdkError<E, HttpResponse>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match &err {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => {
            let detail = match &err {
                SdkError::TimeoutError(_) => "timed out".to_string(),
                _ => innermost_cause(&err),
            };
            StoreError::Unreachable { endpoint: endpoint.to_string(), detail: crate::redact_text(&detail) }
        }
        _ => {
            let status = err.raw_response().map(|r| r.status().as_u16());
            let code = err.code().map(str::to_string);
            match (status, code.as_deref()) {
                (_, Some("NoSuchBucket")) => StoreError::NoSuchBucket { url: url.to_string(), bucket: opts.bucket.clone() },
                (_, Some("NoSuchKey")) | (Some(404), _) => StoreError::NotFound { url: url.to_string() },
                (_, Some("InvalidAccessKeyId" | "SignatureDoesNotMatch" | "AccessDenied" | "InvalidToken")) | (Some(401 | 403), _) => {
                    StoreError::Credentials {
                        context: format!("{url}: the server rejected the credentials"),
                        detail: code.unwrap_or_else(|| format!("HTTP {}", status.unwrap_or(0))),
                    }
                }
                _ => StoreError::Backend {
                    url: url.to_string(),
                    detail: match (status, code) {
                        (Some(s), Some(c)) => format!("HTTP {s} {c}: {}", err.message().unwrap_or("")),
                        (Some(s), None) => format!("HTTP {s}"),
                        _ => innermost_cause(&err),
                    },
                },
            }
        }
    }
}

/// The SDK's error chain is long; the innermost cause is the specific one
/// (e.g. "Connection refused (os error 111)").
fn innermost_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut current = err;
    let mut message = err.to_string();
    while let Some(next) = current.source() {
        let text = next.to_string();
        if !text.trim().is_empty() {
            message = text;
        }
        current = next;
    }
    message
}

#[async_trait]
impl ObjectStore for S3Store {
    fn url(&self) -> String {
        display_url(&self.opts)
    }

    fn folder_url(&self, prefix: &str) -> String {
        self.opts.url_at(prefix)
    }

    async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let full = self.full_key(key)?;
        self.client
            .put_object()
            .bucket(&self.opts.bucket)
            .key(full)
            .body(ByteStream::from(bytes))
            .send()
            .await
            .map_err(|e| self.map_err(key, e))?;
        Ok(())
    }

    async fn put_if_absent(&self, key: &str, bytes: Bytes) -> Result<PutOutcome> {
        let full = self.full_key(key)?;
        // A 409 means a concurrent conditional write is in flight; retry until it settles.
        for attempt in 0..8u32 {
            let res = self
                .client
                .put_object()
                .bucket(&self.opts.bucket)
                .key(&full)
                .if_none_match("*")
                .body(ByteStream::from(bytes.clone()))
                .send()
                .await;
            match res {
                Ok(_) => return Ok(PutOutcome::Created),
                Err(e) => {
                    let status = e.raw_response().map(|r| r.status().as_u16());
                    match status {
                        Some(412) => return Ok(PutOutcome::AlreadyExists),
                        Some(409) => {
                            tokio::time::sleep(Duration::from_millis(20 << attempt.min(5))).await;
                            continue;
                        }
                        _ => return Err(self.map_err(key, e)),
                    }
                }
            }
        }
        Err(StoreError::Backend { url: self.object_url(key), detail: "conditional put kept conflicting (HTTP 409); retry later".into() })
    }

    async fn get(&self, key: &str) -> Result<Bytes> {
        self.get_object(key, None).await
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        if range.end <= range.start {
            return Ok(Bytes::new());
        }
        self.get_object(key, Some(format!("bytes={}-{}", range.start, range.end - 1))).await
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        let full = self.full_key(key)?;
        match self.client.head_object().bucket(&self.opts.bucket).key(full).send().await {
            Ok(out) => Ok(Some(ObjectMeta { key: key.to_string(), size: out.content_length().unwrap_or(0).max(0) as u64 })),
            Err(e) => match self.map_err(key, e) {
                StoreError::NotFound { .. } => Ok(None),
                other => Err(other),
            },
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        check_prefix(prefix)?;
        let full_prefix = if self.opts.prefix.is_empty() { prefix.to_string() } else { format!("{}/{prefix}", self.opts.prefix) };
        let mut pages = self.client.list_objects_v2().bucket(&self.opts.bucket).prefix(full_prefix).into_paginator().send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.map_err(prefix, e))?;
            for obj in page.contents() {
                if let Some(k) = obj.key() {
                    out.push(ObjectMeta { key: self.strip(k), size: obj.size().unwrap_or(0).max(0) as u64 });
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let full = self.full_key(key)?;
        match self.client.delete_object().bucket(&self.opts.bucket).key(full).send().await {
            Ok(_) => Ok(()),
            Err(e) => match self.map_err(key, e) {
                StoreError::NotFound { .. } => Ok(()),
                other => Err(other),
            },
        }
    }

    async fn put_multipart(&self, key: &str) -> Result<Box<dyn MultipartUpload>> {
        let full = self.full_key(key)?;
        Ok(Box::new(S3Upload {
            store: self.clone(),
            key: key.to_string(),
            full_key: full,
            upload_id: None,
            buf: BytesMut::new(),
            parts: Vec::new(),
            size: 0,
            finished: false,
        }))
    }
}

/// A streaming upload: parts of [`PART_SIZE`] go up as they fill; an object smaller than
/// one part is written with a single put on completion.
struct S3Upload {
    store: S3Store,
    key: String,
    full_key: String,
    upload_id: Option<String>,
    buf: BytesMut,
    parts: Vec<CompletedPart>,
    size: u64,
    finished: bool,
}

impl S3Upload {
    async fn upload_part(&mut self, body: Bytes) -> Result<()> {
        let s = &self.store;
        if self.upload_id.is_none() {
            let out = s
                .client
                .create_multipart_upload()
                .bucket(&s.opts.bucket)
                .key(&self.full_key)
                .send()
                .await
                .map_err(|e| s.map_err(&self.key, e))?;
            self.upload_id = out.upload_id().map(str::to_string);
            if self.upload_id.is_none() {
                return Err(StoreError::Backend { url: s.object_url(&self.key), detail: "no upload id returned".into() });
            }
        }
        let number = self.parts.len() as i32 + 1;
        let out = s
            .client
            .upload_part()
            .bucket(&s.opts.bucket)
            .key(&self.full_key)
            .upload_id(self.upload_id.clone().expect("set above"))
            .part_number(number)
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(|e| s.map_err(&self.key, e))?;
        self.parts.push(CompletedPart::builder().part_number(number).set_e_tag(out.e_tag().map(str::to_string)).build());
        Ok(())
    }

    fn check_open(&self) -> Result<()> {
        if self.finished {
            return Err(StoreError::Backend {
                url: self.store.object_url(&self.key),
                detail: "upload already completed or aborted".into(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl MultipartUpload for S3Upload {
    async fn write(&mut self, bytes: Bytes) -> Result<()> {
        self.check_open()?;
        self.size += bytes.len() as u64;
        self.buf.extend_from_slice(&bytes);
        while self.buf.len() >= PART_SIZE {
            let part = self.buf.split_to(PART_SIZE).freeze();
            if let Err(e) = self.upload_part(part).await {
                let _ = self.abort().await;
                return Err(e);
            }
        }
        Ok(())
    }

    async fn complete(&mut self) -> Result<ObjectMeta> {
        self.check_open()?;
        let rest = std::mem::take(&mut self.buf).freeze();
        if self.upload_id.is_none() {
            self.finished = true;
            self.store.put(&self.key, rest).await?;
        } else {
            if !rest.is_empty() {
                if let Err(e) = self.upload_part(rest).await {
                    let _ = self.abort().await;
                    return Err(e);
                }
            }
            self.finished = true;
            let s = &self.store;
            let res = s
                .client
                .complete_multipart_upload()
                .bucket(&s.opts.bucket)
                .key(&self.full_key)
                .upload_id(self.upload_id.clone().expect("multipart started"))
                .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(self.parts.clone())).build())
                .send()
                .await;
            if let Err(e) = res {
                let err = s.map_err(&self.key, e);
                self.finished = false;
                let _ = self.abort().await;
                return Err(err);
            }
        }
        Ok(ObjectMeta { key: self.key.clone(), size: self.size })
    }

    async fn abort(&mut self) -> Result<()> {
        self.finished = true;
        self.buf.clear();
        if let Some(id) = self.upload_id.take() {
            let s = &self.store;
            s.client
                .abort_multipart_upload()
                .bucket(&s.opts.bucket)
                .key(&self.full_key)
                .upload_id(id)
                .send()
                .await
                .map_err(|e| s.map_err(&self.key, e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_url_opens_the_same_bucket_and_options_below_the_prefix() {
        let o = S3Options::parse("s3://runs/team/a?endpoint=http://127.0.0.1:8333&region=eu-west-1&path_style=true").unwrap();
        let url = o.url_at("runs/r/checkpoints/step=1/");
        let back = S3Options::parse(&url).unwrap();
        assert_eq!(back.bucket, "runs");
        assert_eq!(back.prefix, "team/a/runs/r/checkpoints/step=1");
        assert_eq!(
            (back.endpoint.as_deref(), back.region.as_deref(), back.path_style),
            (Some("http://127.0.0.1:8333"), Some("eu-west-1"), Some(true))
        );
        let bare = S3Options::parse("s3://b").unwrap();
        assert_eq!(bare.url_at("x/y"), "s3://b/x/y");
        assert_eq!(bare.url_at(""), "s3://b");
    }

    #[test]
    fn a_prefix_that_climbs_is_refused_as_written() {
        for url in ["s3://bucket/../../x", "s3://bucket/a/./b", "s3://bucket/a/%2E%2E/b?region=r"] {
            let e = S3Options::parse(url).unwrap_err().to_string();
            assert!(e.contains("`..` segments"), "{url}: {e}");
        }
        assert_eq!(S3Options::parse("s3://bucket/a..b/c").unwrap().prefix, "a..b/c");
        let o = S3Options::parse("s3://b/p?endpoint=http://u:hunter2@127.0.0.1:1").unwrap();
        assert!(!o.url_at("x").contains("hunter2"), "{}", o.url_at("x"));
    }

    #[test]
    fn parses_bucket_prefix_and_options() {
        let o = S3Options::parse("s3://runs/team/a?endpoint=http://127.0.0.1:8333&region=eu-west-1&path_style=true").unwrap();
        assert_eq!(o.bucket, "runs");
        assert_eq!(o.prefix, "team/a");
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        assert_eq!(o.region.as_deref(), Some("eu-west-1"));
        assert_eq!(o.path_style, Some(true));
        assert_eq!(S3Options::parse("s3://b").unwrap().prefix, "");
    }

    #[test]
    fn rejects_bad_urls_without_echoing_secrets() {
        let err = S3Options::parse("s3://AKIA:supersecret@bucket/x").unwrap_err().to_string();
        assert!(!err.contains("supersecret"), "{err}");
        assert!(err.contains("credentials do not belong in the URL"), "{err}");
        assert!(S3Options::parse("s3://b/x?colour=red").unwrap_err().to_string().contains("unknown option `colour`"));
        assert!(S3Options::parse("s3://b/x?path_style=maybe").is_err());
    }
}
