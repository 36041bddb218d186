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
    /// Print an object: Parquet rows as JSON lines, other objects as they are; a prefix
    /// ending in `/`: the rows of every Parquet object under it.
    Cat(CatArgs),
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// A store URL (file:///tmp/x, s3://bucket/runs/r1), or a prefix in `--store`
    /// (`runs/quickstart/metrics/`); default: all of `--store`.
    pub location: Option<String>,
    /// Only keys starting with this prefix (relative to the location).
    #[arg(long, default_value = "")]
    pub prefix: String,
    #[command(flatten)]
    pub store: super::StoreArg,
}

#[derive(Debug, Args)]
pub struct CatArgs {
    /// An object URL (file:///tmp/x/a.parquet, s3://bucket/runs/r1/state.json), or a key
    /// in `--store` (`runs/quickstart/state.json`). A prefix ending in `/`
    /// (`runs/quickstart/trajectories/`) prints the rows of every Parquet object under it.
    pub object: String,
    /// Print at most this many rows (of all the files together).
    #[arg(long)]
    pub limit: Option<usize>,
    #[command(flatten)]
    pub store: super::StoreArg,
}

/// Whether a positional location is a URL of its own rather than a key in `--store`.
fn is_url(location: &str) -> bool {
    location.contains("://") || location.starts_with('/')
}

pub async fn run(cmd: StoreCommand) -> anyhow::Result<u8> {
    match cmd {
        StoreCommand::Ls(a) => ls(a).await,
        StoreCommand::Cat(a) => cat(a).await,
    }
}

async fn ls(args: LsArgs) -> anyhow::Result<u8> {
    let (url, prefix) = match &args.location {
        Some(l) if is_url(l) => (l.clone(), args.prefix.clone()),
        Some(l) => (args.store.url(), format!("{l}{}", args.prefix)),
        None => (args.store.url(), args.prefix.clone()),
    };
    // A local store that is not there is a typo more often than an empty store.
    if !url.contains("://") || url.starts_with("file://") {
        let path = url.strip_prefix("file://").unwrap_or(&url);
        if !std::path::Path::new(path).is_dir() {
            let looked_for = match &args.location {
                Some(l) if !is_url(l) => format!(" to list `{l}` in (a location without `://` is a key prefix in --store)"),
                _ => String::new(),
            };
            anyhow::bail!(
                "no store at `{}`{looked_for}: the folder does not exist (give file:///abs/dir or s3://bucket/prefix)",
                infra::redact_url(&url)
            );
        }
    }
    let store = open_store(&url).await?;
    let objects = store.list(&prefix).await?;
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
    let (store, key) =
        if is_url(&args.object) { open_object(&args.object).await? } else { (args.store.open().await?, args.object.clone()) };
    let mut out = std::io::stdout().lock();
    let mut remaining = args.limit.unwrap_or(usize::MAX);
    if key.is_empty() || key.ends_with('/') {
        // A prefix: the rows of every Parquet object under it, in key order (`list` sorts).
        let keys: Vec<String> = store.list(&key).await?.into_iter().map(|o| o.key).filter(|k| k.ends_with(".parquet")).collect();
        if keys.is_empty() {
            anyhow::bail!("no Parquet object under `{key}`: `harness-s store ls` shows what the store holds");
        }
        for k in &keys {
            print_rows(store.as_ref(), k, &mut remaining, &mut out).await?;
        }
    } else if key.ends_with(".parquet") {
        print_rows(store.as_ref(), &key, &mut remaining, &mut out).await?;
    } else {
        let bytes = store.get(&key).await?;
        out.write_all(&bytes)?;
    }
    Ok(crate::exit::OK)
}

/// Prints a Parquet object's rows as JSON lines, at most `remaining` of them (counted down).
async fn print_rows(store: &dyn infra::store::ObjectStore, key: &str, remaining: &mut usize, out: &mut impl Write) -> anyhow::Result<()> {
    let file = ParquetFile::open(store, key).await?;
    let url = file.url.clone();
    let mut writer = arrow_json::LineDelimitedWriter::new(out);
    for batch in file.batches()? {
        if *remaining == 0 {
            break;
        }
        let take = (*remaining).min(batch.num_rows());
        writer.write(&batch.slice(0, take)).with_context(|| format!("{url}: cannot print rows as JSON"))?;
        *remaining -= take;
    }
    writer.finish()?;
    Ok(())
}
