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
