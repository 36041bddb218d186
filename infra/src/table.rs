//! Parquet tables over any [`ObjectStore`]: zstd compression, page statistics, row groups
//! sized per record, and the record name and schema version in every file's key-value
//! metadata. Writers stream: rows go out in row groups through a multipart upload, so
//! memory stays bounded by one row group whatever the file size.
//!
//! Object names use Hive-style partitions (see [`schemas::keys`]), so that
//! `read_parquet('…/**/*.parquet', hive_partitioning=true)` works in DuckDB, Polars and
//! pyarrow with no harness-s code.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use arrow_array::RecordBatch;
use arrow_schema::{FieldRef, Schema};
use bytes::Bytes;
use futures::future::BoxFuture;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::async_writer::AsyncFileWriter;
use parquet::arrow::AsyncArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use schemas::{OutputEntry, Record, SchemaError, RECORD_KEY, VERSION_KEY};
use sha2::{Digest, Sha256};

use crate::store::{MultipartUpload, ObjectStore, StoreError};

/// Errors of Parquet tables; each names the object.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("{url}: not a readable Parquet file (truncated or corrupt): {detail}")]
    Corrupt { url: String, detail: String },
    #[error("{url}: cannot encode rows: {detail}")]
    Encode { url: String, detail: String },
    #[error("{url}: rows do not match the `{record}` schema: {detail}")]
    Decode { url: String, record: String, detail: String },
}

impl crate::Transient for TableError {
    /// Whether retrying may succeed: only store trouble is transient; a corrupt file or a
    /// schema mismatch fails the same way again.
    fn is_transient(&self) -> bool {
        matches!(self, TableError::Store(e) if e.is_transient())
    }
}

pub type Result<T, E = TableError> = std::result::Result<T, E>;

/// Rows per row group for a record: big enough for good compression and statistics,
/// small enough that a streaming writer holds little in memory. Trajectories nest their
/// turns and are much wider than other records.
fn row_group_rows<R: Record>() -> usize {
    if R::NAME == schemas::Trajectory::NAME {
        1024
    } else {
        16 * 1024
    }
}

fn writer_properties<R: Record>() -> WriterProperties {
    WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).expect("3 is a valid zstd level")))
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_max_row_group_row_count(Some(row_group_rows::<R>()))
        .set_created_by(format!("harness-s {}", env!("CARGO_PKG_VERSION")))
        .set_key_value_metadata(Some(vec![
            KeyValue::new(RECORD_KEY.to_string(), R::NAME.to_string()),
            KeyValue::new(VERSION_KEY.to_string(), R::VERSION.to_string()),
        ]))
        .build()
}

#[derive(Default)]
struct SinkStats {
    size: u64,
    sha256: Sha256,
}

/// Adapts a multipart upload to the Parquet async writer, hashing bytes as they pass.
struct UploadSink {
    upload: Box<dyn MultipartUpload>,
    stats: Arc<Mutex<SinkStats>>,
}

impl AsyncFileWriter for UploadSink {
    fn write(&mut self, bs: Bytes) -> BoxFuture<'_, parquet::errors::Result<()>> {
        Box::pin(async move {
            {
                let mut st = self.stats.lock().expect("stats lock");
                st.size += bs.len() as u64;
                st.sha256.update(&bs);
            }
            self.upload.write(bs).await.map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))
        })
    }

    fn complete(&mut self) -> BoxFuture<'_, parquet::errors::Result<()>> {
        Box::pin(async move {
            self.upload.complete().await.map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))?;
            Ok(())
        })
    }
}

/// A streaming Parquet writer for one part file (`part-<job>.parquet`).
pub struct PartWriter<R: Record> {
    url: String,
    key: String,
    fields: Vec<FieldRef>,
    writer: AsyncArrowWriter<UploadSink>,
    stats: Arc<Mutex<SinkStats>>,
    rows: u64,
    _record: PhantomData<fn(R)>,
}

impl<R: Record> PartWriter<R> {
    /// Starts a part at `key`; nothing is visible under the key until [`Self::finish`].
    pub async fn create(store: &dyn ObjectStore, key: &str) -> Result<Self> {
        let url = store.object_url(key);
        let fields = R::try_fields()?;
        let schema = Arc::new(Schema::new(fields.clone()));
        let upload = store.put_multipart(key).await?;
        let stats = Arc::new(Mutex::new(SinkStats::default()));
        let sink = UploadSink { upload, stats: stats.clone() };
        let writer = AsyncArrowWriter::try_new(sink, schema, Some(writer_properties::<R>()))
            .map_err(|e| TableError::Encode { url: url.clone(), detail: e.to_string() })?;
        Ok(PartWriter { url, key: key.to_string(), fields, writer, stats, rows: 0, _record: PhantomData })
    }

    /// Appends rows; full row groups are encoded and uploaded as they fill.
    pub async fn write(&mut self, rows: &[R]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let batch = serde_arrow::to_record_batch(&self.fields, &rows)
            .map_err(|e| TableError::Encode { url: self.url.clone(), detail: e.to_string() })?;
        self.writer.write(&batch).await.map_err(|e| self.encode_err(e))?;
        self.rows += rows.len() as u64;
        Ok(())
    }

    fn encode_err(&self, e: parquet::errors::ParquetError) -> TableError {
        match e {
            parquet::errors::ParquetError::External(inner) => match inner.downcast::<StoreError>() {
                Ok(store) => TableError::Store(*store),
                Err(other) => TableError::Encode { url: self.url.clone(), detail: other.to_string() },
            },
            other => TableError::Encode { url: self.url.clone(), detail: other.to_string() },
        }
    }

    /// Rows written so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Writes the footer and makes the object visible; returns its done-marker entry.
    pub async fn finish(self) -> Result<OutputEntry> {
        let PartWriter { url, key, writer, stats, .. } = self;
        writer.close().await.map_err(|e| match e {
            parquet::errors::ParquetError::External(inner) => match inner.downcast::<StoreError>() {
                Ok(store) => TableError::Store(*store),
                Err(other) => TableError::Encode { url: url.clone(), detail: other.to_string() },
            },
            other => TableError::Encode { url: url.clone(), detail: other.to_string() },
        })?;
        let st = std::mem::take(&mut *stats.lock().expect("stats lock"));
        Ok(OutputEntry { key, size: st.size, sha256: hex::encode(st.sha256.finalize()) })
    }
}

/// Writes all `rows` as one part file and returns its done-marker entry.
pub async fn write_records<R: Record>(store: &dyn ObjectStore, key: &str, rows: &[R]) -> Result<OutputEntry> {
    let mut w = PartWriter::<R>::create(store, key).await?;
    for chunk in rows.chunks(row_group_rows::<R>()) {
        w.write(chunk).await?;
    }
    w.finish().await
}

/// A Parquet file read from the store, with its harness-s metadata (if any).
pub struct ParquetFile {
    pub url: String,
    /// `(record name, schema version)` from the file metadata, if present.
    pub record: Option<(String, u32)>,
    builder: ParquetRecordBatchReaderBuilder<Bytes>,
}

impl ParquetFile {
    /// Fetches an object and parses its Parquet footer.
    pub async fn open(store: &dyn ObjectStore, key: &str) -> Result<Self> {
        let url = store.object_url(key);
        let bytes = store.get(key).await?;
        let builder =
            ParquetRecordBatchReaderBuilder::try_new(bytes).map_err(|e| TableError::Corrupt { url: url.clone(), detail: e.to_string() })?;
        let kv = builder.metadata().file_metadata().key_value_metadata();
        let lookup = |k: &str| kv.and_then(|kv| kv.iter().find(|e| e.key == k)).and_then(|e| e.value.clone());
        let record = match (lookup(RECORD_KEY), lookup(VERSION_KEY)) {
            (Some(name), Some(v)) => Some((name, v.parse().unwrap_or(0))),
            _ => None,
        };
        Ok(ParquetFile { url, record, builder })
    }

    /// Checks the file holds `R` records of the version this build reads.
    pub fn check<R: Record>(&self) -> Result<()> {
        match &self.record {
            None => Err(SchemaError::MissingVersion { file: self.url.clone(), key: VERSION_KEY }.into()),
            Some((name, _)) if name != R::NAME => {
                Err(SchemaError::WrongRecord { file: self.url.clone(), found: name.clone(), expected: R::NAME.to_string() }.into())
            }
            Some((_, v)) if *v != R::VERSION => Err(SchemaError::UnsupportedVersion {
                file: self.url.clone(),
                record: R::NAME.to_string(),
                found: *v,
                supported: R::VERSION,
            }
            .into()),
            Some(_) => Ok(()),
        }
    }

    /// Row count from the footer.
    pub fn num_rows(&self) -> u64 {
        self.builder.metadata().file_metadata().num_rows().max(0) as u64
    }

    /// Decodes every batch (any schema).
    pub fn batches(self) -> Result<Vec<RecordBatch>> {
        let url = self.url;
        let reader = self.builder.build().map_err(|e| TableError::Corrupt { url: url.clone(), detail: e.to_string() })?;
        reader.map(|b| b.map_err(|e| TableError::Corrupt { url: url.clone(), detail: e.to_string() })).collect()
    }

    /// Decodes typed rows after checking the record name and version.
    pub fn records<R: Record>(self) -> Result<Vec<R>> {
        self.check::<R>()?;
        let url = self.url.clone();
        let mut out = Vec::with_capacity(self.num_rows() as usize);
        for batch in self.batches()? {
            let mut rows: Vec<R> = serde_arrow::from_record_batch(&batch).map_err(|e| TableError::Decode {
                url: url.clone(),
                record: R::NAME.to_string(),
                detail: e.to_string(),
            })?;
            out.append(&mut rows);
        }
        Ok(out)
    }
}

/// Reads every row of one part file, checking record name and schema version.
pub async fn read_records<R: Record>(store: &dyn ObjectStore, key: &str) -> Result<Vec<R>> {
    ParquetFile::open(store, key).await?.records::<R>()
}

/// Reads the parts under `prefix` that a done-marker of run `run_id` commits, in key order
/// (durability rule 4): `…/part-<job>.parquet` counts only when
/// `runs/<run>/jobs/<job>.done.json` exists, so a part of an attempt that never committed
/// is left out. One extra listing (the run's markers), no marker is read.
pub async fn read_committed<R: Record>(store: &dyn ObjectStore, run_id: &str, prefix: &str) -> Result<Vec<R>> {
    let markers: std::collections::BTreeSet<String> =
        store.list(&schemas::keys::jobs_prefix(run_id)).await?.into_iter().map(|m| m.key).collect();
    let mut out = Vec::new();
    for obj in store.list(prefix).await? {
        let committed = schemas::keys::job_of_part(&obj.key).is_some_and(|job| markers.contains(&schemas::keys::done_marker(run_id, job)));
        if committed {
            out.extend(read_records::<R>(store, &obj.key).await?);
        } else if obj.key.ends_with(".parquet") {
            tracing::debug!(key = %obj.key, "part without a done-marker left out (an unfinished attempt)");
        }
    }
    Ok(out)
}

/// Reads every `*.parquet` object under a prefix, in key order (parts the scheduler writes
/// itself, such as metrics and groups, and analysis of a finished run).
pub async fn read_prefix<R: Record>(store: &dyn ObjectStore, prefix: &str) -> Result<Vec<R>> {
    let mut out = Vec::new();
    for obj in store.list(prefix).await? {
        if obj.key.ends_with(".parquet") {
            out.extend(read_records::<R>(store, &obj.key).await?);
        }
    }
    Ok(out)
}
