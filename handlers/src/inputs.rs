//! A run's inputs in the object store, so that every worker (on any machine) sees the same
//! spec, tasks and pool: `runs/<run>/spec.toml` (as submitted), `runs/<run>/inputs/run.json`
//! (the checked spec with paths resolved), `runs/<run>/inputs/tasks/<split>.jsonl` and
//! `runs/<run>/pool/<harness>.json`. An http environment's tasks live on its server: its
//! splits are the sample indices of the stored spec, and no task file is stored.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use bytes::Bytes;
use infra::store::ObjectStore;
use jobs::env::dbbench::generate::{generate_jsonl, Difficulty, GenerateOptions};
use jobs::env::dbbench::{DbBenchConfig, DbBenchFactory, TaskSet};
use jobs::env::http::HttpFactory;
use jobs::env::EnvironmentFactory;
use schemas::{keys, HarnessSpec, Split};
use serde::{Deserialize, Serialize};

use crate::spec::{LoadedSpec, RunSpec};

/// The stored, resolved form of a run spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredRun {
    pub schema_version: u32,
    pub run_id: String,
    pub spec: RunSpec,
    /// Absolute path of the native model, or of the starting weights of an endpoint policy
    /// that is trained (the learner's start); workers must be able to read it.
    pub base_model: Option<PathBuf>,
    /// An editor run's editor starting weights (absolute; `[editor_training] model`, or
    /// the native policy's model).
    #[serde(default)]
    pub editor_model: Option<PathBuf>,
    /// The trained editor of `[evolution] editor = "learned"`, pinned at submission.
    #[serde(default)]
    pub learned_editor: Option<PinnedEditor>,
    /// Harness ids of the pool, in file-name order (H0 excluded).
    pub pool: Vec<String>,
    /// `[pool] base`: the run's base harness H0 when it is not the unedited one.
    #[serde(default)]
    pub base: Option<HarnessSpec>,
}

/// A checkpoint of an editor run that writes a run's evolution children: the step is fixed
/// when the run is submitted, so a resumed run uses the same weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PinnedEditor {
    pub run: String,
    pub step: u32,
    /// The editor run's starting weights (the tokenizer, when the checkpoint has none).
    pub base_model: PathBuf,
    /// How the editor run cut its packets: the learned editor reads packets cut the same way.
    pub packet: jobs::evolve::packet::PacketSettings,
}

/// `[evolution] learned_editor` resolved against the store: the editor run exists, trained
/// an editor, and has the checkpoint (the latest complete one when no step is given).
pub async fn pin_learned_editor(store: &dyn ObjectStore, l: &crate::spec::LearnedEditorSection) -> anyhow::Result<PinnedEditor> {
    let field = "evolution.learned_editor.run";
    let editor_run = load_stored(store, &l.run)
        .await
        .with_context(|| format!("{field}: no editor run `{}` (train one with an [editor_training] spec first)", l.run))?;
    let Some(training) = &editor_run.spec.editor_training else {
        bail!("{field}: run `{}` trained a policy, not a harness editor; name a run with [editor_training]", l.run);
    };
    let packet = training.packet_settings();
    let base_model = editor_run.editor_model.with_context(|| format!("{field}: run `{}` records no editor model", l.run))?;
    let step = match l.step {
        Some(step) => {
            if store.head(&native::train::checkpoint::manifest_key(&l.run, step)).await?.is_none() {
                bail!("evolution.learned_editor.step: editor run `{}` has no checkpoint at step {step}; `harness-s status {}` shows its latest", l.run, l.run);
            }
            step
        }
        None => match native::train::checkpoint::latest(store, &l.run).await? {
            Some(m) => m.step,
            None => bail!("{field}: editor run `{}` has no complete checkpoint yet; resume it until a step finishes", l.run),
        },
    };
    Ok(PinnedEditor { run: l.run.clone(), step, base_model, packet })
}

impl schemas::Document for StoredRun {
    const NAME: &'static str = "stored run spec";
    const VERSION: u32 = 1;
}

impl StoredRun {
    /// The weights an endpoint policy must serve for rollouts of checkpoint `step` (`None`:
    /// the starting weights), as sent in its weight update: the checkpoint folder of the
    /// run's store ([`jobs::policy::weight_sync::model_path_of`]) or the starting weights'
    /// path. `None` when the run has no starting weights to name.
    pub fn served_weights(&self, store: &dyn ObjectStore, step: Option<u32>) -> Option<String> {
        self.weights_at(store, step, self.base_model.as_ref())
    }

    /// The same for an editor run's endpoint editor: its checkpoint `step`, or its starting
    /// weights.
    pub fn editor_weights(&self, store: &dyn ObjectStore, step: Option<u32>) -> Option<String> {
        self.weights_at(store, step, self.editor_model.as_ref())
    }

    /// The run's checkpoint `step` as a weight update names it, or `start` for `None`.
    fn weights_at(&self, store: &dyn ObjectStore, step: Option<u32>, start: Option<&PathBuf>) -> Option<String> {
        match step {
            Some(s) => Some(jobs::policy::weight_sync::model_path_of(&store.folder_url(&keys::checkpoint_dir(&self.run_id, s)))),
            None => start.map(|p| p.display().to_string()),
        }
    }
}

pub fn run_json_key(run_id: &str) -> String {
    schemas::keys::run_inputs(run_id)
}

pub fn tasks_key(run_id: &str, split: Split) -> String {
    let name = match split {
        Split::Train => "train",
        Split::Validation => "validation",
        Split::Test => "test",
    };
    schemas::keys::task_file(run_id, name)
}

pub const SPLITS: [Split; 3] = [Split::Train, Split::Validation, Split::Test];

/// The members of another run's evolved pool, H0 left out (it is implicit).
pub async fn evolved_pool(store: &dyn ObjectStore, from_run: &str) -> anyhow::Result<Vec<HarnessSpec>> {
    let (_, specs) = jobs::evolve::pool::load_pool(store, from_run)
        .await
        .with_context(|| format!("pool.from_run: cannot load the pool of run `{from_run}` from {}", store.url()))?;
    Ok(specs.into_iter().filter(|h| h.id != schemas::H0_ID).collect())
}

/// Rescue by the router needs K distinct siblings (K/2 for `llm_4x2`).
pub fn check_pool_size(spec: &RunSpec, pool: usize) -> anyhow::Result<()> {
    let variant = spec.router.variant();
    let needed = spec.algorithm.k.div_ceil(variant.rollouts_per_harness());
    if matches!(spec.algorithm.rescue, jobs::rescue::RescueStrategy::Router) && (pool as u32) < needed {
        bail!(
            "algorithm.k = {}: router variant `{variant}` needs at least {needed} distinct siblings, the pool has {pool}",
            spec.algorithm.k
        );
    }
    Ok(())
}

/// Copies a checked spec and its inputs into the store. Idempotent: the same spec gives
/// the same objects.
pub async fn upload(store: &dyn ObjectStore, loaded: &LoadedSpec) -> anyhow::Result<StoredRun> {
    let spec = &loaded.spec;
    let run_id = &loaded.run_id;
    let pool = match (&spec.pool.dir, &spec.pool.from_run) {
        (Some(dir), _) => crate::harnesses::read_pool(&loaded.resolve(dir), &loaded.spec.environment.validate_options())?,
        (None, Some(from)) => evolved_pool(store, from).await?,
        (None, None) => vec![],
    };
    // A refused submission writes nothing: every check comes before the first `put`.
    if spec.evolution.is_none() {
        check_pool_size(spec, pool.len())?;
    }
    if let Some(e) = &spec.editor_training {
        if spec.pool.from_run.is_some() && e.parent != schemas::H0_ID && !pool.iter().any(|h| h.id == e.parent) {
            let ids: Vec<&str> = pool.iter().map(|h| h.id.as_str()).collect();
            bail!("editor_training.parent: `{}` names no harness: use h0 or a member of the pool ({})", e.parent, ids.join(", "));
        }
    }
    if let Some(from) = spec.evolution.as_ref().and_then(|e| e.seed_from.as_deref()) {
        jobs::evolve::pool::load_pool(store, from)
            .await
            .with_context(|| format!("evolution.seed_from: cannot load the pool of run `{from}` from {}", store.url()))?;
    }
    let base = match &spec.pool.base {
        Some(file) => Some(crate::harnesses::read_base(&loaded.resolve(file), &spec.environment.validate_options())?),
        None => None,
    };
    let mut texts: BTreeMap<&'static str, String> = BTreeMap::new();
    match &spec.tasks.generate {
        // The server holds the tasks.
        _ if spec.environment.is_http() => {}
        Some(g) => {
            let difficulty = match g.difficulty.as_deref() {
                None | Some("mixed") => None,
                Some(d) => Some(d.parse::<Difficulty>().map_err(|e| anyhow::anyhow!("tasks.generate.difficulty: {e}"))?),
            };
            for (i, (name, n)) in [("train", g.train), ("validation", g.validation), ("test", g.test)].into_iter().enumerate() {
                let opts = GenerateOptions {
                    seed: jobs::env::dbbench::generate::split_seed(g.seed, i),
                    n,
                    difficulty,
                    kinds: g.kinds.clone().unwrap_or_default(),
                };
                let text = generate_jsonl(&opts).map_err(|e| anyhow::anyhow!("tasks.generate: {e}"))?;
                // a generated line that does not load is a generator bug: never store a
                // split that would load shorter than asked
                if let Some(p) = TaskSet::parse(&text, name, name).problems.first() {
                    bail!("tasks.generate: the generated {name} split does not load ({p}); this is a bug in the task generator");
                }
                texts.insert(name, text);
            }
        }
        None => {
            for (name, file) in [("train", &spec.tasks.train), ("validation", &spec.tasks.validation), ("test", &spec.tasks.test)] {
                let path = loaded.resolve(file.as_ref().expect("checked by the spec"));
                let text = std::fs::read_to_string(&path).with_context(|| format!("tasks.{name}: cannot read {}", path.display()))?;
                let parsed = TaskSet::parse(&text, &path.display().to_string(), name);
                if !parsed.problems.is_empty() {
                    let lines: Vec<String> = parsed.problems.iter().map(|p| p.to_string()).collect();
                    bail!("tasks.{name}: {} bad line(s) in {}:\n  {}", lines.len(), path.display(), lines.join("\n  "));
                }
                if parsed.tasks.is_empty() {
                    bail!("tasks.{name}: {} holds no tasks", path.display());
                }
                if let Some(n) = spec.calibration.tasks.filter(|n| name == "validation" && *n as usize > parsed.tasks.len()) {
                    bail!(
                        "calibration.tasks: {n} is more than the {} validation tasks of {}; use 1 to {}, or leave it out for all of them",
                        parsed.tasks.len(),
                        path.display(),
                        parsed.tasks.len()
                    );
                }
                texts.insert(name, text);
            }
        }
    }
    let base_model = match (spec.policy.backend, &spec.policy.weights) {
        (crate::spec::Backend::Native, _) => Some(native::model::loader::resolve_model(&spec.policy.model, &loaded.base_dir)?),
        // An endpoint policy that is trained: the weights it starts from, for the learner.
        (_, Some(weights)) => Some(native::model::loader::resolve_model(weights, &loaded.base_dir)?),
        _ => None,
    };
    let editor_model = match spec.editor_training.as_ref() {
        Some(e) => match &e.model {
            Some(m) => Some(native::model::loader::resolve_model(m, &loaded.base_dir)?),
            None => base_model.clone(),
        },
        None => None,
    };
    let learned_editor = match spec.evolution.as_ref().and_then(|e| e.learned_editor.as_ref()) {
        Some(l) => Some(pin_learned_editor(store, l).await?),
        None => None,
    };
    let stored = StoredRun {
        schema_version: 1,
        run_id: run_id.clone(),
        spec: spec.clone(),
        base_model,
        editor_model,
        learned_editor,
        pool: pool.iter().map(|h| h.id.clone()).collect(),
        base,
    };
    store.put(&keys::spec(run_id), Bytes::from(loaded.text.clone())).await?;
    for (split, name) in SPLITS.iter().zip(["train", "validation", "test"]) {
        if let Some(text) = texts.get(name) {
            store.put(&tasks_key(run_id, *split), Bytes::from(text.clone())).await?;
        }
    }
    for h in &pool {
        store.put(&keys::pool_harness(run_id, &h.id), Bytes::from(serde_json::to_vec_pretty(h)?)).await?;
    }
    store.put(&run_json_key(run_id), Bytes::from(schemas::encode_document(&stored))).await?;
    Ok(stored)
}

/// The submitted run (`run.json`: spec, base model, pool ids) without its tasks and pool.
pub async fn load_stored(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<StoredRun> {
    let key = run_json_key(run_id);
    let bytes = store.get(&key).await.with_context(|| format!("run `{run_id}` was not submitted to {}", store.url()))?;
    Ok(schemas::decode_document(&store.object_url(&key), &bytes)?)
}

/// Everything a job of a run needs, loaded from the store once per process.
pub struct RunInputs {
    pub stored: StoredRun,
    /// DBBench tasks by split (empty for an http environment, whose server holds them).
    pub tasks: BTreeMap<Split, Arc<TaskSet>>,
    /// Task ids by split, in order: DBBench task ids, or an http environment's sample indices.
    pub task_ids: BTreeMap<Split, Vec<String>>,
    /// The http environment's client, shared by every job of this process (one connection
    /// pool, one session limit).
    http: Option<HttpFactory>,
    /// The pool, H0 excluded, in `stored.pool` order.
    pub pool: Vec<HarnessSpec>,
}

impl RunInputs {
    pub async fn load(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<RunInputs> {
        let stored = load_stored(store, run_id).await?;
        let env = &stored.spec.environment;
        let mut tasks = BTreeMap::new();
        let mut task_ids = BTreeMap::new();
        let mut http = None;
        if env.is_http() {
            let config = env.http_config().map_err(|e| anyhow::anyhow!("run `{run_id}`: {e}"))?;
            http = Some(HttpFactory::new(config).map_err(|e| anyhow::anyhow!("run `{run_id}`: environment.{e}"))?);
            for split in SPLITS {
                task_ids.insert(split, env.http_task_ids(split).map_err(|e| anyhow::anyhow!("run `{run_id}`: {e}"))?);
                tasks.insert(split, Arc::new(TaskSet::default()));
            }
        } else {
            for split in SPLITS {
                let key = tasks_key(run_id, split);
                let text = String::from_utf8(store.get(&key).await?.to_vec()).context("task file is not UTF-8")?;
                let parsed = TaskSet::parse(&text, &store.object_url(&key), "task");
                if let Some(p) = parsed.problems.first() {
                    bail!("run `{run_id}`: {} of the stored task file's lines do not load, first {p}; the run's tasks are not what it was submitted with", parsed.problems.len());
                }
                task_ids.insert(split, parsed.tasks.ids());
                tasks.insert(split, Arc::new(parsed.tasks));
            }
        }
        let mut pool = Vec::new();
        for id in &stored.pool {
            let key = keys::pool_harness(run_id, id);
            let bytes = store.get(&key).await?;
            let h: HarnessSpec = serde_json::from_slice(&bytes).with_context(|| format!("{}: invalid harness", store.object_url(&key)))?;
            pool.push(h);
        }
        Ok(RunInputs { stored, tasks, task_ids, http, pool })
    }

    pub fn spec(&self) -> &RunSpec {
        &self.stored.spec
    }

    /// The run's base harness H0 (`[pool] base`, or the unedited one).
    pub fn base(&self) -> HarnessSpec {
        self.stored.base.clone().unwrap_or_else(HarnessSpec::h0)
    }

    /// The harness with this id (`h0` is the base harness).
    pub fn harness(&self, id: &str) -> Option<HarnessSpec> {
        if id == schemas::H0_ID {
            return Some(self.base());
        }
        self.pool.iter().find(|h| h.id == id).cloned()
    }

    /// The task ids of a split, in order.
    pub fn task_ids(&self, split: Split) -> Vec<String> {
        self.task_ids.get(&split).cloned().unwrap_or_default()
    }

    /// Router and profiler view of tasks of one split, in the given order (unknown ids
    /// skipped). An http environment's samples are known by index only: their type is the
    /// task set, with no description.
    pub fn task_infos(&self, split: Split, ids: &[String]) -> Vec<jobs::profile::TaskInfo> {
        if let Some(http) = &self.http {
            let known = self.task_ids(split);
            let task_set = &http.config().task_set;
            return ids
                .iter()
                .filter(|id| known.contains(id))
                .map(|id| jobs::profile::TaskInfo::new(id.clone(), task_set.clone(), ""))
                .collect();
        }
        let set = &self.tasks[&split];
        ids.iter().filter_map(|id| set.get(id)).map(|t| jobs::profile::TaskInfo::from_db_task(t)).collect()
    }

    /// One environment per episode over the tasks of several splits (evolution diagnoses
    /// train tasks and measures coverage on validation tasks); task ids must not repeat.
    pub fn env_factory_over(&self, splits: &[Split]) -> anyhow::Result<Arc<dyn EnvironmentFactory>> {
        if let Some(http) = &self.http {
            return Ok(Arc::new(http.clone()));
        }
        let mut factory = self.dbbench_factory(splits[0])?;
        let tasks: Vec<jobs::env::dbbench::DbTask> = splits.iter().flat_map(|s| self.tasks[s].iter().map(|t| t.as_ref().clone())).collect();
        let merged = TaskSet::from_tasks(tasks).map_err(|e| anyhow::anyhow!("the train and validation task files share ids: {e}"))?;
        factory.tasks = Arc::new(merged);
        Ok(Arc::new(factory))
    }

    /// One environment per episode, over the tasks of one split (an http environment's
    /// server serves every split).
    pub fn env_factory(&self, split: Split) -> anyhow::Result<Arc<dyn EnvironmentFactory>> {
        if let Some(http) = &self.http {
            return Ok(Arc::new(http.clone()));
        }
        Ok(Arc::new(self.dbbench_factory(split)?))
    }

    fn dbbench_factory(&self, split: Split) -> anyhow::Result<DbBenchFactory> {
        let env = &self.spec().environment;
        let mut config = DbBenchConfig::from_engine_name(env.engine.as_str(), env.db_url.as_deref())?;
        if let Some(r) = env.max_rounds {
            config = config.with_max_rounds(r)?;
        }
        Ok(DbBenchFactory { tasks: self.tasks[&split].clone(), config })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infra::store::LocalStore;

    /// A stored task file with a line that does not load is refused by run and file, never
    /// read as a shorter split.
    #[tokio::test]
    async fn a_stored_task_file_with_lines_that_do_not_load_is_refused() {
        let text = "[run]\nid = \"t1\"\nseed = 3\n[environment]\nkind = \"dbbench\"\n[tasks.generate]\nseed = 1\ntrain = 4\nvalidation = 2\ntest = 2\nkinds = [\"lookup\", \"counting\"]\n[policy]\nbackend = \"openai\"\nmodel = \"m\"\nbase_url = \"http://127.0.0.1:1/v1\"\n[algorithm]\nlearn = false\nk = 2\ntasks_per_update = 2\nupdates = 1\nlearning_rate = 0.0\nrescue = \"h0\"\n";
        let loaded = crate::spec::parse(text, "t.toml", std::path::Path::new("."), "t").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        upload(&store, &loaded).await.unwrap();
        let inputs = RunInputs::load(&store, "t1").await.unwrap();
        assert_eq!(inputs.task_ids(Split::Train).len(), 4, "every generated task loads, lookups (DBBench `other`) too");
        let key = tasks_key("t1", Split::Validation);
        let mut file = store.get(&key).await.unwrap().to_vec();
        file.extend_from_slice(b"{\"id\": \"x\", \"type\": [\"lookup\"]}\n");
        store.put(&key, Bytes::from(file)).await.unwrap();
        let err = RunInputs::load(&store, "t1").await.err().expect("a task file that lost a line is refused").to_string();
        assert!(err.contains("run `t1`") && err.contains("validation"), "{err}");
    }
}
