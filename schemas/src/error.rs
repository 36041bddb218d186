use thiserror::Error;

/// Errors from decoding or describing harness-s records.
#[derive(Debug, Error)]
pub enum SchemaError {
    /// The file was written with a schema version this build cannot read.
    #[error("{file}: `{record}` schema version {found} is not supported by this build (it reads version {supported}); use a harness-s release that matches the writer")]
    UnsupportedVersion { file: String, record: String, found: u32, supported: u32 },
    /// The file holds a different kind of record than the caller asked for.
    #[error("{file}: holds `{found}` records, expected `{expected}`")]
    WrongRecord { file: String, found: String, expected: String },
    /// The file carries no harness-s schema metadata at all.
    #[error("{file}: no `{key}` metadata; it was not written by harness-s (or by a tool that dropped the metadata)")]
    MissingVersion { file: String, key: &'static str },
    /// The document is not valid JSON for its record type.
    #[error("{file}: invalid `{record}` document: {message}")]
    InvalidDocument { file: String, record: String, message: String },
    /// Deriving the Arrow schema of a record type failed (a programming error in a record).
    #[error("cannot derive the Arrow schema of `{record}`: {message}")]
    ArrowSchema { record: String, message: String },
}
