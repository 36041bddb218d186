use std::sync::Arc;

use arrow_schema::{DataType, Field, FieldRef};
use serde::{de::DeserializeOwned, Serialize};
use serde_arrow::schema::{SchemaLike, TracingOptions};

use crate::SchemaError;

/// Parquet key-value metadata key holding the record name.
pub const RECORD_KEY: &str = "harness_s.record";
/// Parquet key-value metadata key holding the schema version.
pub const VERSION_KEY: &str = "harness_s.schema_version";

/// A row type stored as Parquet: one struct per row, nested structs and lists allowed.
pub trait Record: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// Record name written to the file metadata (`harness_s.record`).
    const NAME: &'static str;
    /// Schema version; bump it on any change a reader of the old version cannot read.
    const VERSION: u32;

    /// Arrow fields of this record, derived from its serde shape. Enums without data are
    /// stored as plain strings so that Arrow tools see `"rescue"`, not a union, and the
    /// Hive partition columns stored in files (`step`, `kind`) get the types that Hive
    /// partition discovery infers from object names (int32, string), so that pyarrow,
    /// DuckDB and Polars merge path and file columns without a schema of their own.
    fn fields() -> Vec<FieldRef> {
        Self::try_fields().expect("record types are plain structs with a derivable schema")
    }

    /// Fallible form of [`Record::fields`].
    fn try_fields() -> Result<Vec<FieldRef>, SchemaError> {
        let options =
            TracingOptions::default().enums_without_data_as_strings(true).strings_as_large_utf8(false).sequence_as_large_list(false);
        let traced = Vec::<FieldRef>::from_type::<Self>(options)
            .map_err(|e| SchemaError::ArrowSchema { record: Self::NAME.to_string(), message: e.to_string() })?;
        Ok(traced.into_iter().map(|f| Arc::new(tool_friendly(&f))).collect())
    }
}

/// Rewrites a traced top-level field for Arrow tools: a `step` column becomes int32
/// (what Hive partition discovery infers), and [`plain_strings`] applies below.
fn tool_friendly(f: &Field) -> Field {
    if f.name() == "step" && f.data_type() == &DataType::UInt32 {
        return f.clone().with_data_type(DataType::Int32);
    }
    plain_strings(f)
}

/// Replaces dictionary-encoded strings (serde_arrow's choice for unit enums) with plain
/// strings, recursively through structs and lists.
fn plain_strings(f: &Field) -> Field {
    let data_type = match f.data_type() {
        DataType::Dictionary(_, value) => value.as_ref().clone(),
        DataType::Struct(children) => DataType::Struct(children.iter().map(|c| Arc::new(plain_strings(c))).collect()),
        DataType::List(child) => DataType::List(Arc::new(plain_strings(child))),
        other => other.clone(),
    };
    f.clone().with_data_type(data_type)
}

/// A JSON document with a `schema_version` field (manifests, envelopes, markers, state).
pub trait Document: Serialize + DeserializeOwned {
    /// Human name used in error messages.
    const NAME: &'static str;
    /// The version this build writes and reads.
    const VERSION: u32;
}

/// Encodes a document as pretty JSON.
pub fn encode_document<D: Document>(doc: &D) -> Vec<u8> {
    serde_json::to_vec_pretty(doc).expect("documents serialise to JSON")
}

/// Decodes a document, checking its `schema_version` first so that a newer file gives a
/// version error rather than a confusing field error. `file` names the source in errors.
pub fn decode_document<D: Document>(file: &str, bytes: &[u8]) -> Result<D, SchemaError> {
    #[derive(serde::Deserialize)]
    struct Probe {
        schema_version: Option<u32>,
    }
    let invalid = |message: String| SchemaError::InvalidDocument { file: file.to_string(), record: D::NAME.to_string(), message };
    let probe: Probe = serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
    match probe.schema_version {
        None => return Err(SchemaError::MissingVersion { file: file.to_string(), key: "schema_version" }),
        Some(v) if v != D::VERSION => {
            return Err(SchemaError::UnsupportedVersion {
                file: file.to_string(),
                record: D::NAME.to_string(),
                found: v,
                supported: D::VERSION,
            })
        }
        Some(_) => {}
    }
    serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))
}
