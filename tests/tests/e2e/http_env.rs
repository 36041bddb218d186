//! Environments over HTTP end to end: the `http` environment client
//! (`jobs::env::http`) against the real `harness-s env serve` (DBBench on SQLite, generated
//! tasks) over TCP on 127.0.0.1, through the real rollout job and, for retries, the real
//! worker on a memory queue. The policy is scripted (an oracle that answers some tasks
//! right, some wrong and some never), so rewards are known and the same on both sides.
//!
//! The tests of this file share one lock: they count the server's sessions and the
//! process-wide registry of open sessions.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use harness_s_tests::{free_port, harness_s_bin, unique};
use infra::store::{LocalStore, ObjectStore};
use jobs::env::dbbench::generate::{generate_jsonl, GenerateOptions};
use jobs::env::dbbench::{DbBenchConfig, DbBenchFactory, DbTask, TaskSet};
use jobs::env::http::{HttpConfig, HttpFactory, SessionsReport};
use jobs::env::{EnvError, Environment, EnvironmentFactory, ToolCall, ToolSpec};
use jobs::harness::Budgets;
use jobs::policy::{FinishReason, Message, Policy, PolicyError, PolicyOutput, SamplingParams};
use jobs::rollout::{RolloutContext, RolloutInput};
use schemas::{keys, HarnessSpec, JobEnvelope, JobKind, Role, RolloutKind, Split, Termination, Trajectory};
use serde_json::json;
use worker::{Handler, JobContext, JobFailure, JobOutput, Outcome, Registry, Worker, WorkerConfig};

/// One http test at a time (session counts, the process-wide session registry).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------
// The server

/// A `harness-s env serve` child process on 127.0.0.1.
struct EnvServer {
    child: Child,
    port: u16,
    args: Vec<String>,
    log: PathBuf,
}

impl EnvServer {
    async fn start(port: u16, args: &[String], log: &Path) -> EnvServer {
        let err = std::fs::File::create(log).unwrap();
        let child = Command::new(harness_s_bin())
            .args(["env", "serve", "--addr", &format!("127.0.0.1:{port}")])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::from(err))
            .spawn()
            .expect("harness-s env serve starts");
        let server = EnvServer { child, port, args: args.to_vec(), log: log.to_path_buf() };
        server.wait_ready().await;
        server
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn wait_ready(&self) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if reqwest::get(format!("{}/health", self.url())).await.is_ok_and(|r| r.status().is_success()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("harness-s env serve did not answer within 30 s:\n{}", std::fs::read_to_string(&self.log).unwrap_or_default());
    }

    /// SIGKILL: no graceful shutdown, open sessions are lost with the process.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the server and starts a fresh one on the same port (a restarted machine).
    async fn restart(&mut self) {
        self.kill();
        let log = self.log.with_extension("restarted.log");
        let fresh = EnvServer::start(self.port, &self.args, &log).await;
        *self = fresh;
    }

    async fn sessions(&self) -> SessionsReport {
        reqwest::get(format!("{}/api/sessions", self.url())).await.unwrap().json().await.unwrap()
    }
}

impl Drop for EnvServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Generated DBBench tasks (counting, comparison, INSERT) written as a task file.
fn task_file(dir: &Path, seed: u64, n: usize) -> (PathBuf, Vec<Arc<DbTask>>) {
    let text = generate_jsonl(&GenerateOptions {
        seed,
        n,
        difficulty: None,
        kinds: vec!["counting".into(), "comparison".into(), "INSERT".into()],
    })
    .unwrap();
    let path = dir.join(format!("tasks-{seed}.jsonl"));
    std::fs::write(&path, &text).unwrap();
    let set = TaskSet::parse(&text, "tasks", "tasks");
    assert!(set.problems.is_empty(), "{:?}", set.problems);
    (path, set.tasks.iter().cloned().collect())
}

fn serve_args(tasks: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = vec!["--tasks".to_string(), tasks.display().to_string()];
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

// ---------------------------------------------------------------------------------------
// The scripted policy

/// What the oracle does to the server once, at its first second-turn call.
#[derive(Clone, Copy, PartialEq)]
enum Sabotage {
    None,
    Kill,
    KillAndRestart,
}

/// Answers task `i` (its index in the task file, found by the prompt it sees): task
/// `i % 4 == 3` only talks (the budget ends it, unfinished on the server); otherwise it
/// runs one statement (the gold SQL for an even write task) and commits (the label for an
/// even read task, `wrong` for an odd one; nothing for writes).
struct Oracle {
    tasks: Vec<Arc<DbTask>>,
    sabotage: Sabotage,
    fired: AtomicBool,
    server: Option<Arc<tokio::sync::Mutex<EnvServer>>>,
    calls: AtomicUsize,
}

impl Oracle {
    fn new(tasks: &[Arc<DbTask>]) -> Oracle {
        Oracle { tasks: tasks.to_vec(), sabotage: Sabotage::None, fired: AtomicBool::new(false), server: None, calls: AtomicUsize::new(0) }
    }

    /// The task whose prompt the conversation holds (the longest match).
    fn task_of(&self, messages: &[Message]) -> (usize, Arc<DbTask>) {
        let text: String = messages.iter().filter(|m| m.role == Role::User).map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n");
        self.tasks
            .iter()
            .enumerate()
            .filter(|(_, t)| text.contains(t.prompt().trim()))
            .max_by_key(|(_, t)| t.prompt().len())
            .map(|(i, t)| (i, Arc::clone(t)))
            .expect("the conversation holds a task's prompt")
    }

    /// The index the oracle acts as on task `i` (generated tasks may repeat a prompt: the
    /// oracle then acts as the last task with it).
    fn acts_as(&self, i: usize) -> usize {
        let shown = Message { role: Role::User, content: self.tasks[i].prompt(), tool_calls: vec![] };
        self.task_of(&[shown]).0
    }

    /// The reward the oracle earns on task `i`; `None` when another task asks the same
    /// question of other rows (the oracle cannot tell them apart, so its answer may be
    /// another task's).
    fn expected_reward(&self, i: usize) -> Option<f64> {
        let prompt = self.tasks[i].prompt();
        if self.tasks.iter().filter(|t| t.prompt() == prompt).count() > 1 {
            return None;
        }
        let j = self.acts_as(i);
        Some(if j % 4 == 3 || j % 2 == 1 { 0.0 } else { 1.0 })
    }

    /// Whether the oracle only talks on task `i` (the budget ends it unfinished).
    fn only_talks(&self, i: usize) -> bool {
        self.acts_as(i) % 4 == 3
    }
}

fn reply(text: &str, call: Option<(&str, serde_json::Value)>) -> PolicyOutput {
    PolicyOutput {
        prompt_hash: None,
        text: text.into(),
        tool_calls: call.map(|(n, a)| ToolCall { name: n.into(), args: a }).into_iter().collect(),
        token_ids: vec![1, 2],
        logprobs: vec![-0.5, -0.5],
        prompt_tokens: 10,
        completion_tokens: 2,
        finish_reason: FinishReason::Stop,
    }
}

#[async_trait]
impl Policy for Oracle {
    fn checkpoint(&self) -> String {
        "oracle".into()
    }

    async fn chat(&self, messages: &[Message], _tools: &[ToolSpec], _s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let turn = messages.iter().filter(|m| m.role == Role::Assistant).count();
        let (i, task) = self.task_of(messages);
        if turn == 1 && self.sabotage != Sabotage::None && !self.fired.swap(true, Ordering::SeqCst) {
            let server = self.server.as_ref().expect("a server to sabotage");
            let mut server = server.lock().await;
            match self.sabotage {
                Sabotage::Kill => server.kill(),
                Sabotage::KillAndRestart => server.restart().await,
                Sabotage::None => {}
            }
        }
        if i % 4 == 3 {
            return Ok(reply("I am not sure what to do.", None));
        }
        Ok(if turn == 0 {
            let sql = match task.gold_sql().first() {
                Some(gold) if task.is_write() && i % 2 == 0 => gold.clone(),
                _ => "SELECT 1".to_string(),
            };
            reply("", Some(("execute_sql", json!({ "query": sql }))))
        } else {
            let answers = if task.is_write() {
                json!([])
            } else if i % 2 == 0 {
                task.label.clone()
            } else {
                json!(["wrong"])
            };
            reply("", Some(("commit_final_answer", json!({ "answers": answers }))))
        })
    }
}

// ---------------------------------------------------------------------------------------
// Jobs

fn rollout_input(run: &str, task_ids: Vec<String>, attempts: u32, concurrency: usize) -> RolloutInput {
    RolloutInput {
        run_id: run.to_string(),
        step: 0,
        kind: RolloutKind::Base,
        split: Split::Train,
        task_ids,
        harness: HarnessSpec::h0(),
        attempts,
        seed: 11,
        budgets: Budgets { max_model_calls: 3, ..Default::default() },
        sampling: SamplingParams::default(),
        concurrency,
    }
}

/// Runs one rollout job and reads its rows back from the store.
async fn rollout(
    store: &LocalStore,
    policy: &dyn Policy,
    envs: &dyn EnvironmentFactory,
    input: &RolloutInput,
    job: &str,
) -> Vec<Trajectory> {
    let ctx = RolloutContext { store, policy, envs, job_id: job, delivery_attempt: 0 };
    let out = jobs::rollout::run(&ctx, input).await.unwrap();
    infra::table::read_records(store, &out.outputs[0].key).await.unwrap()
}

fn http_factory(url: &str, concurrency: usize) -> HttpFactory {
    let mut config = HttpConfig::new(url, "dbbench").unwrap();
    config.concurrency = concurrency;
    config.request_timeout = Duration::from_secs(30);
    HttpFactory::new(config).unwrap()
}

fn indices(n: usize) -> Vec<String> {
    (0..n).map(|i| i.to_string()).collect()
}

/// Waits until the server has closed every session (cancels from dropped environments run
/// in spawned tasks).
async fn settled(server: &EnvServer) -> SessionsReport {
    let start = Instant::now();
    loop {
        let r = server.sessions().await;
        if r.open == 0 || start.elapsed() > Duration::from_secs(10) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_environment_gives_the_episodes_and_rewards_of_the_in_process_one() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (file, tasks) = task_file(dir.path(), 5, 12);
    let server = EnvServer::start(free_port(), &serve_args(&file, &[]), &dir.path().join("serve.log")).await;
    let store = LocalStore::new(dir.path().join("store")).unwrap();
    let policy = Oracle::new(&tasks);
    let run = unique("http-equal");

    let local = DbBenchFactory {
        tasks: Arc::new(TaskSet::from_tasks(tasks.iter().map(|t| t.as_ref().clone()).collect()).unwrap()),
        config: DbBenchConfig::sqlite(),
    };
    let ids: Vec<String> = tasks.iter().map(|t| t.id.clone()).collect();
    let in_process = rollout(&store, &policy, &local, &rollout_input(&run, ids, 2, 4), "in-process").await;
    let remote =
        rollout(&store, &policy, &http_factory(&server.url(), 8), &rollout_input(&run, indices(tasks.len()), 2, 4), "over-http").await;

    assert_eq!(in_process.len(), 24);
    assert_eq!(remote.len(), 24);
    for (i, (a, b)) in in_process.iter().zip(&remote).enumerate() {
        let task = i / 2;
        assert_eq!(b.task_id, task.to_string());
        assert_eq!(b.error_class, None, "{:?}", b.error_message);
        assert_eq!((a.reward, a.success, a.termination), (b.reward, b.success, b.termination), "task {task} ({})", a.task_type);
        if let Some(reward) = policy.expected_reward(task) {
            assert_eq!(a.reward, reward, "task {task} ({}): the oracle's reward", a.task_type);
        }
        assert_eq!(a.task_type, b.task_type);
        assert_eq!(a.tool_view, b.tool_view, "the server's tools are DBBench's");
        let turns = |t: &Trajectory| t.turns.iter().map(|t| (t.role, t.source, t.text.clone())).collect::<Vec<_>>();
        assert_eq!(turns(a), turns(b), "task {task}: the same conversation, turn by turn");
        let expected = if policy.only_talks(task) { Termination::BudgetExhausted } else { Termination::Committed };
        assert_eq!(b.termination, expected, "task {task}");
    }
    assert!(remote.iter().any(|r| r.success) && remote.iter().any(|r| !r.success), "rewards of both kinds");

    // Every session ended: the committed ones when the server finished them, the budget's
    // when the client cancelled them.
    let talks = (0..tasks.len()).filter(|i| policy.only_talks(*i)).count() as u64 * 2;
    let report = settled(&server).await;
    assert_eq!(report.open, 0, "{report:?}");
    assert_eq!((report.started, report.finished, report.cancelled, report.expired), (24, 24 - talks, talks, 0), "{report:?}");
    assert!(talks > 0, "some episodes end unfinished on the server");
    assert_eq!(jobs::env::http::open_sessions(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_sessions_all_complete_and_none_leaks() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // The server generates its tasks (`--generate N --seed S`, as `tasks generate` does); the
    // oracle knows them from the same generator.
    let (_, tasks) = task_file(dir.path(), 9, 64);
    let args: Vec<String> =
        ["--generate", "64", "--seed", "9", "--kinds", "counting,comparison,INSERT"].iter().map(|s| s.to_string()).collect();
    let server = EnvServer::start(free_port(), &args, &dir.path().join("serve.log")).await;
    let store = LocalStore::new(dir.path().join("store")).unwrap();
    let policy = Oracle::new(&tasks);
    let rows =
        rollout(&store, &policy, &http_factory(&server.url(), 64), &rollout_input(&unique("http-64"), indices(64), 1, 64), "sixty-four")
            .await;

    assert_eq!(rows.len(), 64);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.error_class, None, "task {i}: {:?}", r.error_message);
        if let Some(reward) = policy.expected_reward(i) {
            assert_eq!(r.reward, reward, "task {i} ({})", r.task_type);
        }
    }
    let known = (0..64).filter(|i| policy.expected_reward(*i).is_some()).count();
    assert!(known >= 16, "rewards known for only {known} of 64 tasks");
    assert!(rows.iter().any(|r| r.success) && rows.iter().any(|r| !r.success), "rewards of both kinds");
    let talks = (0..64).filter(|i| policy.only_talks(*i)).count() as u64;
    assert!(talks >= 10, "the budget ends some episodes unfinished: {talks}");
    let report = settled(&server).await;
    assert_eq!(report.open, 0, "no session leaks: {report:?}");
    assert_eq!((report.started, report.finished, report.cancelled, report.expired), (64, 64 - talks, talks, 0), "{report:?}");
    assert_eq!(jobs::env::http::open_sessions(), 0);
}

/// Runs rollout jobs with the oracle and an http environment, as a run's handler does.
struct RolloutOverHttp {
    policy: Arc<Oracle>,
    envs: HttpFactory,
}

#[async_trait]
impl Handler for RolloutOverHttp {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        let input: RolloutInput = serde_json::from_value(job.payload.clone()).map_err(|e| JobFailure::Fatal(e.to_string()))?;
        let rctx = RolloutContext {
            store: ctx.store.as_ref(),
            policy: self.policy.as_ref(),
            envs: &self.envs,
            job_id: &job.job_id,
            delivery_attempt: job.attempt,
        };
        let out = jobs::rollout::run(&rctx, &input).await.map_err(JobFailure::of)?;
        Ok(JobOutput { outputs: out.outputs, result: serde_json::to_value(&out.summary).unwrap(), committed: true })
    }
}

/// Runs one rollout job through a worker on a memory queue (5 attempts, short backoff)
/// until it settles; returns the outcomes of its deliveries.
async fn through_worker(store: Arc<dyn ObjectStore>, handler: RolloutOverHttp, input: &RolloutInput, job_id: &str) -> Vec<Outcome> {
    let queue =
        infra::queue::open_queue(&format!("memory://{}?prefix=p&max_attempts=5&retry_base_ms=50&retry_max_ms=100", unique("http-retry")))
            .await
            .unwrap();
    let mut registry = Registry::new();
    registry.register(JobKind::Rollout, handler);
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let w = Worker::new(queue.clone(), store, registry, WorkerConfig::new(vec![JobKind::Rollout], 1)).unwrap().with_events(tx);
    let (stop, mut stop_rx) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move {
        w.run(async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        })
        .await
    });
    let envelope = JobEnvelope {
        schema_version: <JobEnvelope as schemas::Document>::VERSION,
        job_id: job_id.to_string(),
        run_id: input.run_id.clone(),
        kind: JobKind::Rollout,
        attempt: 0,
        payload: serde_json::to_value(input).unwrap(),
        created_at_ms: schemas::now_unix_ms(),
        not_before_ms: None,
        deadline_ms: None,
    };
    queue.publish(&envelope).await.unwrap();
    let mut outcomes = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(1), events.recv()).await {
            Ok(Some(e)) => {
                let last = matches!(e.outcome, Outcome::Succeeded | Outcome::DeadLettered { .. });
                outcomes.push(e.outcome);
                if last {
                    break;
                }
            }
            _ => continue,
        }
    }
    let _ = stop.send(true);
    running.await.unwrap().unwrap();
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_episode_retries_the_job_fresh_and_stores_it_once() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (file, tasks) = task_file(dir.path(), 7, 8);
    let port = free_port();
    let server = Arc::new(tokio::sync::Mutex::new(EnvServer::start(port, &serve_args(&file, &[]), &dir.path().join("serve.log")).await));
    let store: Arc<dyn ObjectStore> = Arc::new(LocalStore::new(dir.path().join("store")).unwrap());
    let url = format!("http://127.0.0.1:{port}");
    let run = unique("http-killed");

    // 1. The server is killed mid-episode and comes back (a restart: its sessions are
    //    gone). The delivery fails with the typed, retryable error and writes nothing; the
    //    queue runs the job again, every episode from the start, on the new server.
    let mut oracle = Oracle::new(&tasks);
    let expected: Vec<Option<f64>> = (0..tasks.len()).map(|i| oracle.expected_reward(i)).collect();
    oracle.sabotage = Sabotage::KillAndRestart;
    oracle.server = Some(Arc::clone(&server));
    let input = rollout_input(&run, indices(tasks.len()), 1, 1);
    let outcomes =
        through_worker(store.clone(), RolloutOverHttp { policy: Arc::new(oracle), envs: http_factory(&url, 8) }, &input, "job-restarted")
            .await;
    assert_eq!(outcomes, vec![Outcome::Retried { attempt: 1 }, Outcome::Succeeded], "one retried delivery, then success");
    let part = keys::trajectory_part(&run, 0, RolloutKind::Base, "job-restarted");
    let rows: Vec<Trajectory> = infra::table::read_records(store.as_ref(), &part).await.unwrap();
    assert_eq!(rows.len(), tasks.len(), "each episode stored once");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.error_class, None, "task {i}: {:?}", r.error_message);
        if let Some(reward) = expected[i] {
            assert_eq!(r.reward, reward, "task {i}");
        }
    }
    let parts = store.list(&format!("runs/{run}/trajectories/")).await.unwrap();
    assert_eq!(parts.len(), 1, "one part: {parts:?}");
    assert_eq!(settled(&*server.lock().await).await.open, 0);

    // 2. Killed for good: the retries (job_retries = 2) run out, then the episodes are
    //    recorded with the typed environment error and the job commits once.
    let mut oracle = Oracle::new(&tasks);
    oracle.sabotage = Sabotage::Kill;
    oracle.server = Some(Arc::clone(&server));
    let outcomes =
        through_worker(store.clone(), RolloutOverHttp { policy: Arc::new(oracle), envs: http_factory(&url, 8) }, &input, "job-killed")
            .await;
    assert_eq!(outcomes, vec![Outcome::Retried { attempt: 1 }, Outcome::Retried { attempt: 2 }, Outcome::Succeeded]);
    let part = keys::trajectory_part(&run, 0, RolloutKind::Base, "job-killed");
    let rows: Vec<Trajectory> = infra::table::read_records(store.as_ref(), &part).await.unwrap();
    assert_eq!(rows.len(), tasks.len(), "each episode stored once");
    for r in &rows {
        assert_eq!((r.termination, r.error_class), (Termination::Error, Some(schemas::ErrorClass::Infra)), "{:?}", r.error_message);
        let message = r.error_message.as_deref().unwrap();
        assert!(message.contains("environment backend `http http://127.0.0.1:") && message.contains("cannot connect"), "{message}");
    }
    let markers = store.list(&format!("runs/{run}/jobs/")).await.unwrap();
    assert_eq!(markers.len(), 2, "one done-marker per job: {markers:?}");
    assert_eq!(store.list(&format!("runs/{run}/trajectories/")).await.unwrap().len(), 2);
    assert_eq!(jobs::env::http::open_sessions(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_refuses_bad_requests_expires_idle_sessions_and_clients_cancel_on_every_exit() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (file, tasks) = task_file(dir.path(), 3, 4);
    let server = EnvServer::start(free_port(), &serve_args(&file, &["--session-ttl", "1"]), &dir.path().join("serve.log")).await;
    let url = server.url();
    let http = reqwest::Client::new();
    let post = |route: &str, session: Option<&str>, body: serde_json::Value| {
        let mut r = http.post(format!("{url}/api/{route}")).json(&body);
        if let Some(s) = session {
            r = r.header("session_id", s);
        }
        r.send()
    };
    let error_of = |v: serde_json::Value| v["error"]["message"].as_str().unwrap_or_default().to_string();

    // Bad bodies and headers: a 400 naming the field; unknown samples and sessions: a 404.
    let r = post("start_sample", None, json!({"name": "dbbench"})).await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(error_of(r.json().await.unwrap()).contains("missing field `index`"));
    let r = post("start_sample", None, json!({"name": "dbbench", "index": 99})).await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(error_of(r.json().await.unwrap()).contains("index 99 is not a sample of `dbbench` (0 to 3)"));
    let r = post("start_sample", None, json!({"name": "appworld", "index": 0})).await.unwrap();
    assert_eq!(r.status(), 404);
    let r = post("interact", None, json!({"messages": []})).await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(error_of(r.json().await.unwrap()).contains("missing header `session_id`"));
    let call = json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "execute_sql", "arguments": "{\"query\": \"SELECT 1\"}"}}]}]});
    let r = post("interact", Some("nope"), call.clone()).await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(error_of(r.json().await.unwrap()).contains("unknown session `nope`"));
    let r = post("cancel", Some("nope"), json!({})).await.unwrap();
    assert_eq!(r.status(), 404);

    // A real session: the protocol's shape, then a body without tool calls.
    let r = post("start_sample", None, json!({"name": "dbbench", "index": 1})).await.unwrap();
    assert_eq!(r.status(), 200);
    let session = r.headers()["session_id"].to_str().unwrap().to_string();
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["status"], "running");
    assert_eq!(body["messages"][0]["role"], "user");
    assert_eq!(body["messages"][0]["content"], tasks[1].prompt());
    assert_eq!(body["tools"][0]["function"]["name"], "execute_sql");
    let r = post("interact", Some(&session), json!({"messages": [{"role": "assistant", "content": "hi"}]})).await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(error_of(r.json().await.unwrap()).contains("messages[0].tool_calls is empty"));
    let r = post("interact", Some(&session), json!({"messages": [{"rol": "assistant"}]})).await.unwrap();
    assert_eq!(r.status(), 400);
    let r = post("interact", Some(&session), call.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (body["messages"][0]["role"].as_str(), body["messages"][0]["content"].as_str(), body["finish"].as_bool()),
        (Some("tool"), Some("[(1,)]"), Some(false))
    );

    // Idle past the TTL: the server closes it; the session is then unknown.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let report = server.sessions().await;
    assert_eq!((report.open, report.expired), (0, 1), "{report:?}");
    assert_eq!(post("interact", Some(&session), call).await.unwrap().status(), 404);

    // The client: an unknown sample is a typed, fatal error.
    let factory = http_factory(&url, 4);
    let mut env = factory.env();
    let err = env.reset("99", 0).await.unwrap_err();
    assert!(matches!(err, EnvError::UnknownTask { .. }), "{err}");
    assert!(!infra::Transient::is_transient(&err));

    // An environment dropped mid-episode (its job cancelled) cancels its session.
    let mut env = factory.env();
    env.reset("0", 0).await.unwrap();
    assert_eq!(server.sessions().await.open, 1);
    drop(env);
    let report = settled(&server).await;
    assert_eq!((report.open, report.cancelled), (0, 1), "{report:?}");

    // A stopping worker cancels what its process still holds.
    let start = Instant::now();
    while jobs::env::http::open_sessions() > 0 && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut held = factory.env();
    held.reset("2", 0).await.unwrap();
    assert_eq!(jobs::env::http::open_sessions(), 1);
    assert_eq!(jobs::env::http::cancel_open_sessions(Duration::from_secs(5)).await, 1);
    assert_eq!(jobs::env::http::open_sessions(), 0);
    let report = server.sessions().await;
    assert_eq!((report.open, report.cancelled), (0, 2), "{report:?}");
    held.close().await.unwrap();
}

/// Databases on the MariaDB server whose name starts with `prefix`.
async fn databases_with_prefix(prefix: &str) -> Vec<String> {
    use mysql_async::prelude::Queryable;
    let url = std::env::var("HARNESS_S_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_string());
    let mut conn = mysql_async::Conn::from_url(url).await.expect("MariaDB reachable at 127.0.0.1:3306 (infra/deploy/test.sh starts it)");
    let names: Vec<String> = conn.query("SHOW DATABASES").await.unwrap();
    conn.disconnect().await.unwrap();
    names.into_iter().filter(|n| n.starts_with(prefix)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_environment_on_mariadb_gives_the_rewards_of_sqlite_in_process_and_drops_its_databases() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (file, tasks) = task_file(dir.path(), 5, 8);
    let url = std::env::var("HARNESS_S_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_string());
    let prefix = unique("hs_t_envserve").replace('-', "_");
    let args = serve_args(&file, &["--engine", "mariadb", "--db-url", &url, "--db-prefix", &prefix]);
    let mut server = EnvServer::start(free_port(), &args, &dir.path().join("serve.log")).await;
    let store = LocalStore::new(dir.path().join("store")).unwrap();
    let policy = Oracle::new(&tasks);
    let run = unique("http-mariadb");

    let local = DbBenchFactory {
        tasks: Arc::new(TaskSet::from_tasks(tasks.iter().map(|t| t.as_ref().clone()).collect()).unwrap()),
        config: DbBenchConfig::sqlite(),
    };
    let ids: Vec<String> = tasks.iter().map(|t| t.id.clone()).collect();
    let in_process = rollout(&store, &policy, &local, &rollout_input(&run, ids, 1, 4), "sqlite").await;
    let factory = http_factory(&server.url(), 8);
    let remote = rollout(&store, &policy, &factory, &rollout_input(&run, indices(tasks.len()), 1, 4), "mariadb").await;
    for (i, (a, b)) in in_process.iter().zip(&remote).enumerate() {
        assert_eq!(b.error_class, None, "task {i}: {:?}", b.error_message);
        assert_eq!((a.reward, a.success, a.termination), (b.reward, b.success, b.termination), "task {i} ({})", a.task_type);
    }
    assert_eq!(settled(&server).await.open, 0);
    assert!(databases_with_prefix(&prefix).await.is_empty(), "every session's database is dropped when it ends");

    // SIGTERM with a session open: the server drops its database before it exits.
    let mut held = factory.env();
    held.reset("0", 0).await.unwrap();
    assert_eq!(databases_with_prefix(&prefix).await.len(), 1);
    let status = Command::new("kill").args(["-TERM", &server.child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let start = Instant::now();
    while server.child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(server.child.try_wait().unwrap().is_some_and(|s| s.success()), "env serve exits 0 on SIGTERM");
    assert!(databases_with_prefix(&prefix).await.is_empty(), "the open session's database went with the server");
    held.close().await.unwrap();
    server.kill();
}
