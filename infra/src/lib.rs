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

/// Returns a URL safe to print: the one redaction of every URL harness-s prints, whatever
/// its scheme (amqp, mysql, http(s), s3, file, …). Hidden behind `***`:
/// - the password of the userinfo (`http://user:***@host`), and for `s3://` the user name
///   too (it would be an access key);
/// - the value of every query parameter whose name looks secret ([`SECRET_PARAMS`]:
///   `password`, `token`, `api_key`, `X-Amz-Signature`, …);
/// - the same, recursively, inside a query value that is itself a URL (an `s3://` store's
///   `endpoint=http://user:pass@host`).
///
/// Text that does not parse as a URL (a bad port, a space) still loses everything between
/// the scheme and the last `@`, where a user and password would be. Non-URL strings come
/// back unchanged.
pub fn redact_url(raw: &str) -> String {
    let (base, fragment) = match raw.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (raw, None),
    };
    let (head, query) = match base.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (base, None),
    };
    let mut out = redact_userinfo(head);
    if let Some(q) = query {
        out.push('?');
        out.push_str(&redact_query(q));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(if f.contains('=') { "***" } else { f });
    }
    out
}

/// Query parameter names (lower case, `-` read as `_`) whose values [`redact_url`] hides;
/// a name that ends in one of them (`aws_secret_access_key`, `x_amz_signature`) counts.
pub const SECRET_PARAMS: &[&str] = &[
    "password",
    "passwd",
    "pass",
    "pwd",
    "secret",
    "token",
    "key",
    "apikey",
    "signature",
    "sig",
    "credential",
    "credentials",
    "auth",
    "authorization",
];

fn secret_param(name: &str) -> bool {
    let n = name.to_ascii_lowercase().replace('-', "_");
    SECRET_PARAMS.iter().any(|s| n == *s || n.ends_with(&format!("_{s}")) || (s.len() > 4 && n.ends_with(s)))
}

/// `scheme://user:password@host/path` with the password (and an s3 user) hidden.
fn redact_userinfo(head: &str) -> String {
    let Some(s) = head.find("://") else { return head.to_string() };
    // the last `@` ends the userinfo, even when a password holds an unescaped `/` or `@`
    // (a path rarely holds an `@`; hiding too much is the safe side)
    let Some(at) = head[s + 3..].rfind('@') else { return head.to_string() };
    let userinfo = &head[s + 3..s + 3 + at];
    if userinfo.contains('/') && !userinfo.contains(':') {
        // a path that holds an `@` (`file:///home/a@b/x`), not a user and password
        return head.to_string();
    }
    let shown = match userinfo.split_once(':') {
        _ if userinfo.contains('/') => "***".to_string(),
        Some(_) if head[..s].eq_ignore_ascii_case("s3") => "***".to_string(),
        Some((user, _)) => format!("{user}:***"),
        None if head[..s].eq_ignore_ascii_case("s3") => "***".to_string(),
        None => userinfo.to_string(),
    };
    format!("{}{shown}{}", &head[..s + 3], &head[s + 3 + at..])
}

/// A query string with secret-looking values hidden and URL values redacted.
fn redact_query(query: &str) -> String {
    let parts: Vec<String> = query
        .split('&')
        .map(|pair| {
            let Some((k, v)) = pair.split_once('=') else { return pair.to_string() };
            let name: String =
                url::form_urlencoded::parse(format!("{k}=").as_bytes()).map(|(k, _)| k.into_owned()).next().unwrap_or_default();
            if secret_param(&name) {
                return format!("{k}=***");
            }
            let value: String =
                url::form_urlencoded::parse(format!("v={v}").as_bytes()).map(|(_, v)| v.into_owned()).next().unwrap_or_default();
            if value.contains("://") {
                let redacted = redact_url(&value);
                if redacted != value {
                    return format!("{k}={redacted}");
                }
            }
            pair.to_string()
        })
        .collect();
    parts.join("&")
}

/// `text` with every URL in it (a word containing `://`) passed through [`redact_url`]:
/// for messages that quote a URL inside other text (an HTTP client's error, say).
pub fn redact_text(text: &str) -> String {
    if !text.contains("://") {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.contains("://") {
            out.push_str(&redact_url(word));
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in text.chars() {
        if c.is_whitespace() || matches!(c, '`' | '"' | '\'' | '(' | ')' | '<' | '>' | '[' | ']' | ',') {
            flush(&mut word, &mut out);
            out.push(c);
        } else {
            word.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
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
        assert_eq!(r, "amqp://guest:***@127.0.0.1:99999/%2f");
        assert!(!super::redact_url("s3://k:p@ss@w0rd@bucket:x/p").contains("w0rd"));
        assert!(!super::redact_url("http://u:pa/ss@host:1/v1").contains("ss@"), "a raw `/` in a password");
        assert_eq!(super::redact_url("file:///home/a@b/x"), "file:///home/a@b/x");
        assert_eq!(super::redact_url("not a url"), "not a url");
    }

    #[test]
    fn one_redaction_for_every_scheme_query_and_nested_url() {
        use super::redact_url;
        for (raw, secret, kept) in [
            ("http://u:hunter2@host:1/v1", "hunter2", "http://u:***@host:1/v1"),
            ("https://u:hunter2@exa mple/v1", "hunter2", "https://u:***@exa mple/v1"),
            ("mysql://root:hunter2@127.0.0.1:3306", "hunter2", "mysql://root:***@127.0.0.1:3306"),
            ("s3://bucket/p?endpoint=http://u:hunter2@127.0.0.1:1", "hunter2", "s3://bucket/p?endpoint=http://u:***@127.0.0.1:1"),
            (
                "s3://bucket/p?endpoint=http%3A%2F%2Fu%3Ahunter2%40h%3A1&region=r",
                "hunter2",
                "s3://bucket/p?endpoint=http://u:***@h:1&region=r",
            ),
            ("http://host/v1?api_key=hunter2&model=m", "hunter2", "http://host/v1?api_key=***&model=m"),
            ("https://b.s3.amazonaws.com/k?X-Amz-Signature=hunter2&X-Amz-Credential=hunter3", "hunter2", "X-Amz-Signature=***"),
            ("amqp://h/%2f?password=hunter2&prefix=x", "hunter2", "amqp://h/%2f?password=***&prefix=x"),
            ("http://host/v1#access_token=hunter2", "hunter2", "http://host/v1#***"),
        ] {
            let r = redact_url(raw);
            assert!(!r.contains(secret), "{raw} -> {r}");
            assert!(r.contains(kept), "{raw} -> {r}, expected {kept}");
        }
        // what is not secret stays as given
        for plain in ["http://127.0.0.1:8080/v1", "amqp://guest@h:5672/%2f?prefix=a&max_attempts=3", "file:///tmp/x", "s3://b/p?region=r"] {
            assert_eq!(redact_url(plain), plain);
        }
        let t = super::redact_text("cannot reach http://u:hunter2@h:1/v1/models: refused (http://u:hunter2@h:1)");
        assert!(!t.contains("hunter2") && t.contains("http://u:***@h:1/v1/models"), "{t}");
    }
}
