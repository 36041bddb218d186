//! `harness-s store ls|cat`: quick inspection of any object store.

use std::io::Write;

use anyhow::Context;
use clap::{Args, Subcommand};
use infra::store::{open_object, open_store};
use infra::table::ParquetFile;

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// List objects under a store URL (file:///dir, s3://bucket/prefix?endpoint=...).
    Ls(LsArgs),
    /// Print an object: Parquet rows as JSON lines, other objects as they are.
    Cat(CatArgs),
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// Store URL, optionally with a prefix: file:///tmp/x, s3://bucket/runs/r1
    pub url: String,
    /// Only keys starting with this prefix (relative to the URL).
    #[arg(long, default_value = "")]
    pub prefix: String,
}

#[derive(Debug, Args)]
pub struct CatArgs {
    /// Object URL: file:///tmp/x/a.parquet, s3://bucket/runs/r1/state.json
    pub url: String,
    /// Print at most this many rows of a Parquet file.
    #[arg(long)]
    pub limit: Option<usize>,
}

pub async fn run(cmd: StoreCommand) -> anyhow::Result<u8> {
    match cmd {
        StoreCommand::Ls(a) => ls(a).await,
        StoreCommand::Cat(a) => cat(a).await,
    }
}

async fn ls(args: LsArgs) -> anyhow::Result<u8> {
    // A local store that is not there is a typo more often than an empty store.
    if !args.url.contains("://") || args.url.starts_with("file://") {
        let path = args.url.strip_prefix("file://").unwrap_or(&args.url);
        if !std::path::Path::new(path).is_dir() {
            anyhow::bail!("no store at `{}`: the folder does not exist (give file:///abs/dir or s3://bucket/prefix)", infra::redact_url(&args.url));
        }
    }
    let store = open_store(&args.url).await?;
    let objects = store.list(&args.prefix).await?;
    let mut out = std::io::stdout().lock();
    let mut total = 0u64;
    for o in &objects {
        total += o.size;
        writeln!(out, "{:>12}  {}", o.size, o.key)?;
    }
    writeln!(out, "{} objects, {} bytes", objects.len(), total)?;
    Ok(crate::exit::OK)
}

async fn cat(args: CatArgs) -> anyhow::Result<u8> {
    let (store, key) = open_object(&args.url).await?;
    let mut out = std::io::stdout().lock();
    if key.ends_with(".parquet") {
        let file = ParquetFile::open(store.as_ref(), &key).await?;
        let url = file.url.clone();
        let mut remaining = args.limit.unwrap_or(usize::MAX);
        let mut writer = arrow_json::LineDelimitedWriter::new(&mut out);
        for batch in file.batches()? {
            if remaining == 0 {
                break;
            }
            let take = remaining.min(batch.num_rows());
            writer.write(&batch.slice(0, take)).with_context(|| format!("{url}: cannot print rows as JSON"))?;
            remaining -= take;
        }
        writer.finish()?;
    } else {
        let bytes = store.get(&key).await?;
        out.write_all(&bytes)?;
    }
    Ok(crate::exit::OK)
}
