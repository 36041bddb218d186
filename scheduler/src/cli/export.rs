//! `harness-s export gguf RUN --out FILE [--step N]`: a run's trained policy as a GGUF for
//! llama.cpp, Ollama and the like. The tokenizer, chat template and hyper-parameters come
//! from the GGUF the run started from; the weights from the checkpoint, as F32 (exact),
//! F16 or Q8_0 matrices (`--type`).

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

use super::StoreArg;

#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// Write a checkpoint's weights as a GGUF file (F32, F16 or Q8_0) that llama.cpp loads.
    Gguf(GgufArgs),
}

#[derive(Debug, Args)]
pub struct GgufArgs {
    /// Run id.
    pub run: String,
    /// The GGUF file to write.
    #[arg(long, value_name = "FILE")]
    pub out: std::path::PathBuf,
    /// Checkpoint step; default: the latest complete checkpoint.
    #[arg(long)]
    pub step: Option<u32>,
    /// Type of the matrices: `f32` (the checkpoint exactly), `f16` or `q8_0` (a quarter of
    /// the size); norms and biases stay F32.
    #[arg(long = "type", value_name = "TYPE", value_enum, default_value_t = GgufType::F32)]
    pub ty: GgufType,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum GgufType {
    F32,
    F16,
    Q8_0,
}

impl From<GgufType> for native::model::export::TensorType {
    fn from(t: GgufType) -> Self {
        match t {
            GgufType::F32 => Self::F32,
            GgufType::F16 => Self::F16,
            GgufType::Q8_0 => Self::Q8_0,
        }
    }
}

pub async fn run(cmd: ExportCommand) -> anyhow::Result<u8> {
    match cmd {
        ExportCommand::Gguf(a) => gguf(a).await,
    }
}

async fn gguf(args: GgufArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    let stored = crate::run::inputs::load_stored(store.as_ref(), &args.run).await?;
    let Some(base) = stored.base_model.as_ref().filter(|p| p.is_file()) else {
        bail!(
            "run `{}` did not start from a GGUF file ({}): the export copies the tokenizer and chat template from the starting GGUF",
            args.run,
            stored.base_model.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "no starting weights".into())
        );
    };
    let base = native::model::gguf::GgufFile::open(base).with_context(|| format!("reading the run's starting GGUF {}", base.display()))?;
    let step = match args.step {
        Some(s) => s,
        None => {
            native::train::checkpoint::latest(store.as_ref(), &args.run)
                .await?
                .with_context(|| format!("run `{}` has no checkpoint yet (nothing was trained)", args.run))?
                .step
        }
    };
    let (model, _, manifest) = native::train::checkpoint::load_model(store.as_ref(), &args.run, step, native::device::Device::Cpu)
        .await
        .with_context(|| format!("loading checkpoint step {step} of run `{}`", args.run))?;
    let bytes = native::model::export::gguf_bytes_as(&base, model.llama("GGUF export")?, args.ty.into())?;
    std::fs::write(&args.out, &bytes).with_context(|| format!("--out {}", args.out.display()))?;
    println!(
        "{}: step {step} of run `{}` (weights of step {}), {} tensors ({:?} matrices), {} bytes",
        args.out.display(),
        args.run,
        manifest.weights_step.map(|s| s.to_string()).unwrap_or_else(|| "the starting model".into()),
        base.tensors.len(),
        args.ty,
        bytes.len()
    );
    Ok(crate::exit::OK)
}
