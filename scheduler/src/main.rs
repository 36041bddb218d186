//! `harness-s`: the command line of harness-s. Parses arguments with clap into checked
//! settings, then calls the libraries; exit codes are explicit (see [`scheduler::exit`]).

use clap::Parser;

fn main() -> std::process::ExitCode {
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
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(scheduler::exit::FAILED)
        }
    }
}
