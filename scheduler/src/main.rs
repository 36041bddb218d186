//! `harness-s`: the command line of harness-s. Parses arguments with clap into checked
//! settings, then calls the libraries; exit codes are explicit (see [`scheduler::exit`]).

use clap::Parser;

/// glibc gives each thread that allocates its own arena; the learner's and checkpoints'
/// gigabyte-sized buffers, freed on one blocking thread and allocated on another, then stay
/// mapped in several arenas (measured: 10 GB peak RSS for the quickstart, 8 GB with two
/// arenas, the same run time).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn limit_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; called before any other thread starts.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn limit_malloc_arenas() {}

/// libtorch's CPU allocator asks for transparent huge pages on its buffers of 2 MB and
/// more when `THP_MEM_ALLOC_ENABLE` is set. A learn step allocates gigabytes of activations
/// and gradients afresh for every micro-batch; in 4 KB pages the kernel faults and clears
/// each one (9 % of the quickstart's time in `clear_page`). Measured on the quickstart: the
/// GRPO updates took 18.2, 18.3 and 9.3 s instead of 21.4, 20.6 and 10.5, and the run 2:09
/// instead of 2:27, with the same figures. libtorch reads the variable once, at its first
/// allocation, so it is set before anything runs; a value the user set stays.
fn huge_pages_for_libtorch() {
    if std::env::var_os("THP_MEM_ALLOC_ENABLE").is_none() {
        // SAFETY: no other thread exists yet (called first thing in main).
        std::env::set_var("THP_MEM_ALLOC_ENABLE", "1");
    }
}

/// A closed pipe (`harness-s ... | head`) ends the program quietly: `println!` panics on
/// it, and `writeln!` returns the error; neither is worth a message.
fn quiet_on_closed_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info)
    }));
}

fn is_closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

fn main() -> std::process::ExitCode {
    limit_malloc_arenas();
    huge_pages_for_libtorch();
    quiet_on_closed_pipe();
    let cli = scheduler::cli::Cli::parse();
    scheduler::cli::init_tracing(&cli.global);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(scheduler::exit::FAILED);
        }
    };
    match runtime.block_on(scheduler::cli::dispatch(cli)) {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) if is_closed_pipe(&e) => std::process::ExitCode::from(scheduler::exit::OK),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(scheduler::exit::FAILED)
        }
    }
}
