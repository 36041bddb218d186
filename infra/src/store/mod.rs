//! The object-store seam: one trait, one file per backend.
//!
//! Guarantees every backend gives (checked by the shared suite in `tests/e2e/storage.rs`
//! against both backends):
//! - `put` is atomic: a reader sees the old object, the new one, or nothing; never a part.
//! - `put_if_absent` creates the object only if no object has that key; of several racing
//!   callers exactly one gets [`PutOutcome::Created`], the rest [`PutOutcome::AlreadyExists`].
//!   Done-markers use it.
//! - `list` returns every object whose key starts with the prefix, sorted by key, and never
//!   an unfinished upload or temporary file.
//! - `delete` of a missing key succeeds (idempotent).
//! - A multipart upload is invisible until `complete`; `abort` leaves nothing behind.

mod local;
mod s3;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

pub use local::LocalStore;
pub use s3::{S3Options, S3Store};

/// Size and key of a stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: String,
    pub size: u64,
}

/// Result of [`ObjectStore::put_if_absent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Created,
    AlreadyExists,
}

/// Errors of object stores. Messages name the object or setting and never carry
/// credentials.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{url}: no such object")]
    NotFound { url: String },
    #[error("invalid store URL `{url}`: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("invalid object key `{key}`: {reason}")]
    InvalidKey { key: String, reason: String },
    #[error("cannot reach the S3 endpoint {endpoint}: {detail}; check the store URL's `endpoint=` or AWS_ENDPOINT_URL, and that the server is running")]
    Unreachable { endpoint: String, detail: String },
    #[error("{context}: {detail}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with a credentials file")]
    Credentials { context: String, detail: String },
    #[error("{url}: bucket `{bucket}` does not exist; create it first (e.g. `aws s3 mb s3://{bucket}`)")]
    NoSuchBucket { url: String, bucket: String },
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{url}: {detail}")]
    Backend { url: String, detail: String },
}

impl crate::Transient for StoreError {
    /// Whether retrying the same call later may succeed (network trouble, throttling).
    fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unreachable { .. } | StoreError::Backend { .. })
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An object store holding everything a run produces. Keys are `/`-separated relative
/// paths such as `runs/r1/jobs/abc.done.json`.
#[async_trait]
pub trait ObjectStore: Send + Sync + fmt::Debug {
    /// Base URL of the store, safe to print (credentials redacted).
    fn url(&self) -> String;

    /// Full URL of an object, safe to print.
    fn object_url(&self, key: &str) -> String {
        let base = self.url();
        let base = base.trim_end_matches('/');
        if key.is_empty() {
            base.to_string()
        } else {
            format!("{base}/{key}")
        }
    }

    /// A URL that [`open_store`] opens as a store rooted at `prefix` of this one: the same
    /// backend and options (S3 endpoint, region, path style), never credentials. How another
    /// process is told where a folder of this store is (a checkpoint for an inference
    /// server's weight update).
    fn folder_url(&self, prefix: &str) -> String;

    /// Writes an object atomically, replacing any previous one.
    async fn put(&self, key: &str, bytes: Bytes) -> Result<()>;

    /// Writes an object only if the key is free (exactly one winner under races).
    async fn put_if_absent(&self, key: &str, bytes: Bytes) -> Result<PutOutcome>;

    /// Reads a whole object; [`StoreError::NotFound`] if it does not exist.
    async fn get(&self, key: &str) -> Result<Bytes>;

    /// Reads a byte range of an object.
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes>;

    /// Size of an object, or `None` if it does not exist.
    async fn head(&self, key: &str) -> Result<Option<ObjectMeta>>;

    /// Every object whose key starts with `prefix`, sorted by key.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>>;

    /// Deletes an object; deleting a missing object succeeds.
    async fn delete(&self, key: &str) -> Result<()>;

    /// Starts a streaming upload for a large object, invisible until completed.
    async fn put_multipart(&self, key: &str) -> Result<Box<dyn MultipartUpload>>;
}

/// A streaming upload started by [`ObjectStore::put_multipart`].
#[async_trait]
pub trait MultipartUpload: Send {
    /// Appends bytes; the backend flushes parts as they fill.
    async fn write(&mut self, bytes: Bytes) -> Result<()>;
    /// Makes the object visible under its key, atomically.
    async fn complete(&mut self) -> Result<ObjectMeta>;
    /// Discards everything written.
    async fn abort(&mut self) -> Result<()>;
}

/// Checks that a key is a clean relative path: every backend calls it (through
/// [`check_prefix`] for listings), so no key or prefix can name anything outside the store.
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(StoreError::InvalidKey { key: key.to_string(), reason: "empty".into() });
    }
    check_prefix(key)?;
    if key.ends_with('/') {
        return Err(StoreError::InvalidKey { key: key.to_string(), reason: "a key names an object, not a folder".into() });
    }
    Ok(())
}

/// Checks a listing prefix (a key's start: empty, or ending in `/`, is fine): relative, no
/// `.`/`..` segment, no NUL or other control character, no backslash.
pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    let bad = |reason: &str| Err(StoreError::InvalidKey { key: prefix.escape_debug().to_string(), reason: reason.to_string() });
    if prefix.starts_with('/') {
        return bad("keys are relative; remove the leading `/`");
    }
    if prefix.split('/').any(|seg| seg == ".." || seg == ".") {
        return bad("`.` and `..` segments are not allowed");
    }
    if prefix.chars().any(|c| c.is_control()) {
        return bad("control characters (NUL, newline, ...) are not allowed");
    }
    if prefix.contains('\\') {
        return bad("backslashes are not allowed; separate folders with `/`");
    }
    Ok(())
}

/// The one commit protocol: a job's done-marker is written last, after every output it
/// lists, with `put_if_absent`, so its presence means the job's outputs are complete and
/// of several deliveries of one job exactly one marker stands. Outputs are deterministic
/// per job id, so a delivery that finds the marker written by another commits nothing and
/// reports [`PutOutcome::AlreadyExists`]. Used by the worker for handlers that return
/// their outputs, and by the jobs that commit themselves (rollout, re-anchoring: they are
/// also run outside a worker, by `harness-s rollout`).
pub async fn commit(store: &dyn ObjectStore, marker_key: &str, marker: &schemas::DoneMarker) -> Result<PutOutcome> {
    let outcome = store.put_if_absent(marker_key, Bytes::from(schemas::encode_document(marker))).await?;
    if outcome == PutOutcome::AlreadyExists {
        tracing::info!(job = %marker.job_id, "another delivery of this job committed first; its outputs are identical");
    }
    Ok(outcome)
}

/// A store URL with a plain relative path made a `file://` URL of its absolute folder
/// (taken relative to the current folder); other URLs come back unchanged.
pub fn absolute_url(url: &str) -> String {
    if url.contains("://") {
        url.to_string()
    } else {
        let p = std::path::absolute(url).unwrap_or_else(|_| std::path::PathBuf::from(url));
        format!("file://{}", p.display())
    }
}

/// Opens the store a URL names: `file:///abs/dir` (or a plain path) → [`LocalStore`],
/// `s3://bucket/prefix[?endpoint=URL&region=R&path_style=true]` → [`S3Store`].
pub async fn open_store(url: &str) -> Result<Arc<dyn ObjectStore>> {
    if url.starts_with("s3://") {
        Ok(Arc::new(S3Store::connect(url).await?))
    } else if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(StoreError::InvalidUrl {
                url: crate::redact_url(url),
                reason: "file URLs need an absolute path: file:///abs/dir".into(),
            });
        }
        Ok(Arc::new(LocalStore::new(path)?))
    } else if url.contains("://") {
        Err(StoreError::InvalidUrl {
            url: crate::redact_url(url),
            reason: "unsupported scheme; use file:///abs/dir or s3://bucket/prefix".into(),
        })
    } else {
        Ok(Arc::new(LocalStore::new(url)?))
    }
}

/// Splits an object URL into its store and key, for commands that take one object
/// (`harness-s store cat URL`): the store is rooted at the filesystem root or the bucket.
pub async fn open_object(url: &str) -> Result<(Arc<dyn ObjectStore>, String)> {
    let invalid = |reason: &str| StoreError::InvalidUrl { url: crate::redact_url(url), reason: reason.into() };
    if let Some(rest) = url.strip_prefix("s3://") {
        let (path, query) = rest.split_once('?').map(|(p, q)| (p, Some(q))).unwrap_or((rest, None));
        let (bucket, key) = path.split_once('/').ok_or_else(|| invalid("expected s3://bucket/key"))?;
        let root = match query {
            Some(q) => format!("s3://{bucket}?{q}"),
            None => format!("s3://{bucket}"),
        };
        Ok((open_store(&root).await?, key.to_string()))
    } else {
        let path = url.strip_prefix("file://").unwrap_or(url);
        let abs = std::path::absolute(path).map_err(|e| invalid(&e.to_string()))?;
        let key = abs.to_string_lossy().trim_start_matches('/').to_string();
        Ok((Arc::new(LocalStore::new("/")?), key))
    }
}
