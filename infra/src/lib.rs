//! Adapters between harness-s and the outside world, one trait per external service with
//! its guarantees documented, one file per backend:
//!
//! - [`store::ObjectStore`]: where everything a run produces lives. [`store::LocalStore`]
//!   (`file://`, the embedded default) and [`store::S3Store`] (`s3://`, any S3-compatible
//!   server). [`store::open_store`] picks one from a URL.
//! - [`table`]: Parquet writing and reading of [`schemas::Record`]s over any store, with the
//!   record name and schema version in each file's metadata.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use infra::store::open_store;
//! let store = open_store("file:///tmp/harness-s-demo").await?;
//! store.put("runs/r1/hello.txt", bytes::Bytes::from_static(b"hi")).await?;
//! assert_eq!(&store.get("runs/r1/hello.txt").await?[..], b"hi");
//! # Ok(()) }
//! ```

pub mod queue;
pub mod store;
pub mod table;

/// Whether an error may pass if the same call (or job) is tried again later: network
/// trouble, throttling, a restarting server. Every error a job can end with implements it,
/// and the worker turns it into a retry or a dead letter in one place
/// (`worker::JobFailure::of`); bad input, corrupt data and wrong settings are never
/// transient.
pub trait Transient {
    fn is_transient(&self) -> bool;
}

/// Returns a URL safe to print: any password (and a user name that looks like an access
/// key) is replaced by `***`. Non-URL strings come back unchanged.
pub fn redact_url(raw: &str) -> String {
    match url::Url::parse(raw) {
        Ok(mut u) => {
            let had_secret = u.password().is_some();
            if had_secret {
                let _ = u.set_password(Some("***"));
            }
            if u.scheme() == "s3" && !u.username().is_empty() {
                let _ = u.set_username("***");
            }
            u.to_string()
        }
        // Unparseable (a bad port, say): hide everything between the scheme and the last
        // `@`, where a user and password would be.
        Err(_) => match (raw.find("://"), raw.rfind('@')) {
            (Some(s), Some(at)) if at > s + 3 => format!("{}***{}", &raw[..s + 3], &raw[at..]),
            _ => raw.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_passwords_in_urls() {
        let r = super::redact_url("amqp://guest:hunter2@127.0.0.1:5672/%2f");
        assert!(!r.contains("hunter2"), "{r}");
        assert!(r.contains("guest:***@127.0.0.1"), "{r}");
        assert_eq!(super::redact_url("file:///tmp/x"), "file:///tmp/x");
        assert!(!super::redact_url("s3://KEY:SECRET@bucket/p").contains("SECRET"));
        // URLs that do not parse still lose their secrets
        let r = super::redact_url("amqp://guest:hunter2xyz@127.0.0.1:99999/%2f");
        assert_eq!(r, "amqp://***@127.0.0.1:99999/%2f");
        assert!(!super::redact_url("s3://k:p@ss@w0rd@bucket:x/p").contains("w0rd"));
        assert_eq!(super::redact_url("not a url"), "not a url");
    }
}
