//! Fault-injection tests of the OpenAI-compatible client against a small HTTP server on
//! 127.0.0.1 that answers from a script (errors, invalid bodies, slow answers). The real
//! llama.cpp server is exercised by the end-to-end tests (`tests/tests/e2e/rollout.rs`).

use std::sync::{Arc, Mutex};

use infra::Transient;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// One scripted answer of the chat route.
#[derive(Clone)]
struct Reply {
    status: u16,
    body: String,
    delay: Duration,
    /// Extra header lines (`name: value\r\n` each).
    headers: String,
}

fn reply(status: u16, body: impl Into<String>) -> Reply {
    Reply { status, body: body.into(), delay: Duration::ZERO, headers: String::new() }
}

fn ok(content: &str) -> Reply {
    reply(200, completion(content, json!(null)).to_string())
}

/// A chat completion with the given text, tool calls and single-character logprob pieces.
fn completion(content: &str, tool_calls: Value) -> Value {
    let pieces: Vec<Value> =
        content.chars().map(|c| json!({"token": c.to_string(), "logprob": -0.5, "bytes": null, "top_logprobs": []})).collect();
    let mut message = json!({"role": "assistant", "content": content});
    if !tool_calls.is_null() {
        message["tool_calls"] = tool_calls;
    }
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": {"content": pieces}}],
        "usage": {"prompt_tokens": 11, "completion_tokens": content.chars().count(), "total_tokens": 0}
    })
}

#[derive(Debug, Clone)]
struct Seen {
    path: String,
    head: String,
    body: Value,
}

/// The scripted server. `/v1/chat/completions` plays `script` (the last reply repeats);
/// `/extras/tokenize` answers when `tokenizer` is on (BOS id 1, then one id per character:
/// its code point), else 404, as does `/tokenize`.
struct Server {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    async fn start(script: Vec<Reply>, tokenizer: bool) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let script = Arc::new(Mutex::new((script, 0usize)));
        let seen_c = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let seen = seen_c.clone();
                let script = script.clone();
                tokio::spawn(async move { serve(stream, seen, script, tokenizer).await });
            }
        });
        Server { url, seen }
    }

    fn chat_requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().iter().filter(|s| s.path.ends_with("/chat/completions")).cloned().collect()
    }
}

async fn serve(mut stream: TcpStream, seen: Arc<Mutex<Vec<Seen>>>, script: Arc<Mutex<(Vec<Reply>, usize)>>, tokenizer: bool) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let Ok(n) = stream.read(&mut chunk).await else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let Ok(n) = stream.read(&mut chunk).await else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
    let body: Value = serde_json::from_slice(&buf[head_end..head_end + length]).unwrap_or(Value::Null);
    seen.lock().unwrap().push(Seen { path: path.clone(), head: head.clone(), body: body.clone() });
    let answer = if path == "/v1/chat/completions" {
        let mut guard = script.lock().unwrap();
        let (replies, next) = &mut *guard;
        let r = replies[(*next).min(replies.len() - 1)].clone();
        *next += 1;
        r
    } else if path == "/extras/tokenize" && tokenizer {
        let text = body["input"].as_str().unwrap_or("");
        let ids: Vec<u32> = std::iter::once(1).chain(text.chars().map(|c| c as u32)).collect();
        reply(200, json!({"tokens": ids}).to_string())
    } else {
        reply(404, r#"{"detail":"Not Found"}"#)
    };
    tokio::time::sleep(answer.delay).await;
    let response = format!(
        "HTTP/1.1 {} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{}\r\n{}",
        answer.status,
        answer.body.len(),
        answer.headers,
        answer.body
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// A config with fast backoff so retry tests take milliseconds.
fn config(url: &str) -> OpenAiConfig {
    let mut c = OpenAiConfig::new(url, "m");
    c.min_backoff_ms = 10;
    c.max_backoff_ms = 40;
    c.max_attempts = 3;
    c.request_timeout_s = 5.0;
    c.retry_budget_s = 30.0;
    c
}

fn user(text: &str) -> Vec<Message> {
    vec![Message::new(Role::System, "You answer."), Message::new(Role::User, text)]
}

fn sql_tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "execute_sql".into(),
            description: "Run one SQL statement.".into(),
            parameters: json!({"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}),
        },
        ToolSpec {
            name: "commit_final_answer".into(),
            description: "Commit the answer.".into(),
            parameters: json!({"type": "object", "properties": {"answers": {"type": "array", "items": {"type": "string"}}}, "required": ["answers"]}),
        },
    ]
}

#[tokio::test]
async fn server_error_then_success_is_retried_and_requests_logprobs() {
    let server = Server::start(vec![reply(500, "boom"), ok("OK")], false).await;
    let policy = OpenAiPolicy::new(config(&server.url)).unwrap();
    let out = policy.chat(&user("hi"), &[], &SamplingParams { seed: Some(7), ..Default::default() }).await.unwrap();
    assert_eq!(out.text, "OK");
    assert_eq!(out.logprobs, vec![-0.5, -0.5]);
    assert_eq!((out.prompt_tokens, out.completion_tokens), (11, 2));
    assert_eq!(out.finish_reason, FinishReason::Stop);
    let requests = server.chat_requests();
    assert_eq!(requests.len(), 2, "one failed attempt, one retry");
    let body = &requests[1].body;
    assert_eq!(body["logprobs"], true);
    assert_eq!(body["top_logprobs"], 0);
    assert_eq!(body["model"], "m");
    assert_eq!(body["seed"], 7);
    assert!(body.get("tools").is_none(), "no tools offered, none sent");
}

#[tokio::test]
async fn rate_limit_is_retried() {
    let server = Server::start(vec![reply(429, r#"{"error":{"message":"slow down"}}"#), ok("fine")], false).await;
    let out = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap();
    assert_eq!(out.text, "fine");
    assert_eq!(server.chat_requests().len(), 2);
}

#[tokio::test]
async fn invalid_json_is_retried_then_typed() {
    let server = Server::start(vec![reply(200, "<html>proxy error</html>")], false).await;
    let err = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap_err();
    match &err {
        PolicyError::RetriesExhausted { attempts, last, .. } => {
            assert_eq!(*attempts, 3);
            assert!(matches!(**last, PolicyError::InvalidOutput { .. }), "{last:?}");
        }
        other => panic!("expected RetriesExhausted, got {other:?}"),
    }
    assert_eq!(err.class(), schemas::ErrorClass::InvalidOutput);
    assert!(!err.is_transient(), "the budget is spent; callers must not retry again");
    assert!(err.to_string().contains("proxy error"), "{err}");
    assert_eq!(server.chat_requests().len(), 3);
}

#[tokio::test]
async fn json_without_choices_is_invalid_output() {
    let server = Server::start(vec![reply(200, r#"{"choices": []}"#), ok("ok")], false).await;
    let out = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap();
    assert_eq!(out.text, "ok");
    assert_eq!(server.chat_requests().len(), 2);
}

#[tokio::test]
async fn slow_answer_times_out_and_is_retried() {
    let slow = Reply { delay: Duration::from_secs(3), ..ok("late") };
    let server = Server::start(vec![slow, ok("quick")], false).await;
    let mut c = config(&server.url);
    c.request_timeout_s = 0.3;
    let out = OpenAiPolicy::new(c).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap();
    assert_eq!(out.text, "quick");
    assert_eq!(server.chat_requests().len(), 2);
}

#[tokio::test]
async fn always_slow_server_gives_a_typed_timeout() {
    let slow = Reply { delay: Duration::from_secs(3), ..ok("late") };
    let server = Server::start(vec![slow], false).await;
    let mut c = config(&server.url);
    c.request_timeout_s = 0.2;
    c.max_attempts = 2;
    let err = OpenAiPolicy::new(c).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap_err();
    assert_eq!(err.class(), schemas::ErrorClass::Timeout, "{err:?}");
    assert!(matches!(err, PolicyError::RetriesExhausted { attempts: 2, .. }), "{err:?}");
}

#[tokio::test]
async fn retry_budget_stops_retries_before_max_attempts() {
    let server = Server::start(vec![reply(503, "overloaded")], false).await;
    let mut c = config(&server.url);
    c.max_attempts = 50;
    c.min_backoff_ms = 100;
    c.max_backoff_ms = 100;
    c.retry_budget_s = 0.5;
    let err = OpenAiPolicy::new(c).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap_err();
    let PolicyError::RetriesExhausted { attempts, last, .. } = &err else { panic!("{err:?}") };
    assert!(matches!(**last, PolicyError::Http { status: 503, .. }));
    assert_eq!(err.class(), schemas::ErrorClass::Infra);
    // Backoff with jitter is 100-200 ms per retry: a 0.5 s budget fits a handful, never 50.
    assert!(*attempts >= 2 && *attempts < 10, "attempts = {attempts}");
    assert_eq!(server.chat_requests().len() as u32, *attempts);
}

#[tokio::test]
async fn client_errors_are_not_retried() {
    let server = Server::start(vec![reply(400, r#"{"error":{"message":"bad temperature"}}"#)], false).await;
    let err = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap_err();
    assert!(matches!(&err, PolicyError::Http { status: 400, detail } if detail.contains("bad temperature")), "{err:?}");
    assert_eq!(server.chat_requests().len(), 1);
}

#[tokio::test]
async fn context_overflow_is_typed() {
    // llama-cpp-python's body for a prompt larger than n_ctx.
    let body = r#"{"error":{"message":"This model's maximum context length is 2048 tokens, however you requested 2100 tokens (2000 in your prompt; 100 for the completion). Please reduce your prompt; or completion length.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
    let server = Server::start(vec![reply(400, body)], false).await;
    let err = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap_err();
    assert!(matches!(err, PolicyError::ContextLength { tokens: 2100, limit: 2048 }), "{err:?}");
    assert_eq!(err.class(), schemas::ErrorClass::ContextLength);
    assert_eq!(server.chat_requests().len(), 1);
}

#[tokio::test]
async fn unreachable_server_is_infra() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    drop(listener);
    let mut c = config(&url);
    c.max_attempts = 2;
    let err = OpenAiPolicy::new(c).unwrap().chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap_err();
    let PolicyError::RetriesExhausted { last, .. } = &err else { panic!("{err:?}") };
    assert!(matches!(**last, PolicyError::Unreachable { .. }), "{last:?}");
    assert_eq!(err.class(), schemas::ErrorClass::Infra);
}

#[tokio::test]
async fn api_key_is_sent_but_never_shown() {
    let var = format!("HARNESS_S_TEST_KEY_{}", std::process::id());
    std::env::set_var(&var, "sk-very-secret");
    let server = Server::start(vec![reply(401, r#"{"error":{"message":"invalid key"}}"#)], false).await;
    let mut c = config(&server.url);
    c.api_key_env = Some(var.clone());
    let policy = OpenAiPolicy::new(c).unwrap();
    let err = policy.chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap_err();
    let head = server.chat_requests()[0].head.to_ascii_lowercase();
    assert!(head.contains("authorization: bearer sk-very-secret"), "{head}");
    assert!(matches!(err, PolicyError::Http { status: 401, .. }));
    for shown in [err.to_string(), format!("{err:?}"), format!("{policy:?}")] {
        assert!(!shown.contains("sk-very-secret"), "key leaked: {shown}");
    }
    assert!(err.to_string().contains("api_key_env"), "the error says where the key comes from: {err}");

    let mut missing = config(&server.url);
    missing.api_key_env = Some(format!("{var}_MISSING"));
    let err = OpenAiPolicy::new(missing).unwrap_err();
    assert!(matches!(&err, PolicyError::Config(m) if m.contains(&format!("{var}_MISSING"))), "{err}");
}

#[test]
fn bad_configs_name_the_field() {
    let err = OpenAiPolicy::new(OpenAiConfig::new("localhost:8080", "m")).unwrap_err();
    assert!(err.to_string().contains("base_url"), "{err}");
    let err = OpenAiPolicy::new(OpenAiConfig::new("http://127.0.0.1:1/v1", " ")).unwrap_err();
    assert!(err.to_string().contains("model"), "{err}");
    let mut c = OpenAiConfig::new("http://127.0.0.1:1/v1", "m");
    c.request_timeout_s = 0.0;
    assert!(OpenAiPolicy::new(c).unwrap_err().to_string().contains("request_timeout_s"));
    let toml_like: Result<OpenAiConfig, _> = serde_json::from_value(json!({"base_url": "http://x/v1", "model": "m", "api_key": "k"}));
    assert!(toml_like.unwrap_err().to_string().contains("api_key"), "unknown fields are refused");
}

#[tokio::test]
async fn native_tool_calls_are_sent_and_read() {
    let calls = json!([{"id": "c1", "type": "function", "function": {"name": "execute_sql", "arguments": "{\"query\": \"SELECT 1\"}"}}]);
    let mut body = completion("", calls);
    body["choices"][0]["finish_reason"] = json!("tool_calls");
    let server = Server::start(vec![reply(200, body.to_string())], false).await;
    let policy = OpenAiPolicy::new(config(&server.url)).unwrap();
    let out = policy.chat(&user("count"), &sql_tools(), &SamplingParams::default()).await.unwrap();
    assert_eq!(out.tool_calls, vec![ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT 1"}) }]);
    assert_eq!(out.finish_reason, FinishReason::ToolCalls);
    let sent = &server.chat_requests()[0].body;
    assert_eq!(sent["tools"][0]["function"]["name"], "execute_sql");
    assert_eq!(sent["tool_choice"], "auto");
}

#[tokio::test]
async fn native_mode_reads_json_call_lines_but_not_shorthands() {
    let text = "```sql\nSELECT 2\n```\nAction: {\"name\": \"commit_final_answer\", \"arguments\": {\"answers\": [\"2\"]}}";
    let server = Server::start(vec![ok(text)], false).await;
    let out = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("q"), &sql_tools(), &SamplingParams::default()).await.unwrap();
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].name, "commit_final_answer");
}

#[tokio::test]
async fn text_protocol_describes_tools_and_parses_the_reply() {
    let server = Server::start(vec![ok("Action: Operation\n```sql\nSELECT count(*) FROM t;\n```")], false).await;
    let mut c = config(&server.url);
    c.tool_protocol = ToolProtocol::Text;
    let policy = OpenAiPolicy::new(c).unwrap();
    let mut history = user("How many rows?");
    history.push(Message {
        role: Role::Assistant,
        content: String::new(),
        tool_calls: vec![ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT 1"}) }],
    });
    history.push(Message::new(Role::Tool, "[(1,)]"));
    let out = policy.chat(&history, &sql_tools(), &SamplingParams::default()).await.unwrap();
    assert_eq!(out.tool_calls, vec![ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT count(*) FROM t;"}) }]);
    assert_eq!(out.finish_reason, FinishReason::ToolCalls);
    let sent = &server.chat_requests()[0].body;
    assert!(sent.get("tools").is_none(), "text protocol sends no tools");
    let messages = sent["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);
    let system = messages[0]["content"].as_str().unwrap();
    assert!(system.starts_with("You answer.") && system.contains("- execute_sql: Run one SQL statement."), "{system}");
    assert_eq!(messages[2]["content"], "Action: {\"arguments\":{\"query\":\"SELECT 1\"},\"name\":\"execute_sql\"}");
    assert_eq!(messages[3]["content"], "[(1,)]");
}

#[test]
fn native_wire_messages_pair_tool_results_with_calls() {
    let call = |q: &str| ToolCall { name: "execute_sql".into(), args: json!({"query": q}) };
    let messages = vec![
        Message::new(Role::System, "s"),
        Message::new(Role::User, "u"),
        Message { role: Role::Assistant, content: String::new(), tool_calls: vec![call("A"), call("B")] },
        Message::new(Role::Tool, "ra"),
        Message::new(Role::Tool, "rb"),
        Message::new(Role::Tool, "orphan"),
        Message::new(Role::System, "hint"),
    ];
    let wire = wire_messages(&messages, &[], ToolProtocol::Native);
    assert_eq!(wire[2]["tool_calls"][1]["id"], "call_2_1");
    assert_eq!(wire[2]["tool_calls"][0]["function"]["arguments"], "{\"query\":\"A\"}");
    assert_eq!((wire[3]["role"].as_str(), wire[3]["tool_call_id"].as_str()), (Some("tool"), Some("call_2_0")));
    assert_eq!(wire[4]["tool_call_id"], "call_2_1");
    assert_eq!(wire[5]["role"], "user", "a result with no open call is shown as a user message");
    assert_eq!(wire[6]["role"], "system");
}

/// A worked example placed as chat turns: the assistant's call is only in its text, then a
/// tool result. The call is sent as the message's `tool_calls` and the result answers it,
/// so the server renders a tool result where the policy saw one (a `user` message would be
/// another prompt than the one the learner rebuilds).
#[test]
fn native_wire_messages_give_an_example_call_shown_in_text_its_result() {
    let messages = vec![
        Message::new(Role::System, "s"),
        Message::new(Role::User, "how many?"),
        Message::new(Role::Assistant, "```sql\nSELECT COUNT(*) FROM t;\n```"),
        Message::new(Role::Tool, "[(2,)]"),
        Message::new(Role::Assistant, "no call here"),
        Message::new(Role::Tool, "orphan"),
    ];
    let wire = wire_messages(&messages, &sql_tools(), ToolProtocol::Native);
    assert_eq!(wire[2]["content"], "```sql\nSELECT COUNT(*) FROM t;\n```", "the text stays as the policy saw it");
    assert_eq!(wire[2]["tool_calls"][0]["function"]["name"], "execute_sql");
    assert_eq!((wire[3]["role"].as_str(), wire[3]["tool_call_id"].as_str()), (Some("tool"), Some("call_3_shown")));
    assert!(wire[4].get("tool_calls").is_none());
    assert_eq!(wire[5]["role"], "user", "a result after a reply that shows no call stays a user message");
}

#[tokio::test]
async fn token_ids_carried_by_the_response_are_used() {
    let mut body = completion("ab", json!(null));
    body["choices"][0]["logprobs"]["content"] = json!([
        {"id": 10, "token": "a", "logprob": -0.1},
        {"id": 11, "token": "b", "logprob": -0.2}
    ]);
    let server = Server::start(vec![reply(200, body.to_string())], false).await;
    let out = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("q"), &[], &SamplingParams::default()).await.unwrap();
    assert_eq!(out.token_ids, vec![10, 11]);
    assert_eq!(out.logprobs, vec![-0.1, -0.2]);
    assert!(server.seen.lock().unwrap().iter().all(|s| !s.path.contains("tokenize")), "no tokenizer call needed");
}

#[tokio::test]
async fn token_ids_come_from_the_tokenizer_endpoint_without_bos() {
    let server = Server::start(vec![ok("OK")], true).await;
    let out = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("q"), &[], &SamplingParams::default()).await.unwrap();
    assert_eq!(out.token_ids, vec!['O' as u32, 'K' as u32], "BOS dropped, one id per sampled piece");
    assert_eq!(out.token_ids.len(), out.logprobs.len());
}

#[tokio::test]
async fn token_ids_stay_empty_when_pieces_do_not_align() {
    // One sampled piece "ab" that the tokenizer splits in two: no exact ids exist.
    let mut body = completion("ab", json!(null));
    body["choices"][0]["logprobs"]["content"] = json!([{"token": "ab", "logprob": -0.1}]);
    let server = Server::start(vec![reply(200, body.to_string())], true).await;
    let out = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("q"), &[], &SamplingParams::default()).await.unwrap();
    assert!(out.token_ids.is_empty());
    assert_eq!(out.logprobs.len(), 1);
}

#[tokio::test]
async fn no_tokenizer_endpoint_leaves_ids_empty_but_keeps_logprobs() {
    let server = Server::start(vec![ok("hey")], false).await;
    let out = OpenAiPolicy::new(config(&server.url)).unwrap().chat(&user("q"), &[], &SamplingParams::default()).await.unwrap();
    assert!(out.token_ids.is_empty());
    assert_eq!(out.logprobs.len(), 3);
}

#[test]
fn text_wire_messages_show_calls_the_text_does_not() {
    let call = ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT 1"}) };
    let messages = vec![
        Message::new(Role::System, "base"),
        Message::new(Role::System, "rules"),
        Message::new(Role::User, "task"),
        // The policy's own text already shows its call: left as written.
        Message { role: Role::Assistant, content: "```sql\nSELECT 1\n```".into(), tool_calls: vec![call.clone()] },
        Message::new(Role::Tool, "[(1,)]"),
        // A hook forced a call and explained it in words: the call is appended.
        Message { role: Role::Assistant, content: "Checking the table first.".into(), tool_calls: vec![call.clone()] },
        Message::new(Role::System, "late note"),
    ];
    let wire = wire_messages(&messages, &sql_tools(), ToolProtocol::Text);
    let roles: Vec<&str> = wire.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant", "user"]);
    let system = wire[0]["content"].as_str().unwrap();
    assert!(system.starts_with("base\n\nrules\n\nYou can use these tools:"), "{system}");
    assert_eq!(wire[2]["content"], "```sql\nSELECT 1\n```");
    assert_eq!(wire[4]["content"], "Checking the table first.\nAction: {\"arguments\":{\"query\":\"SELECT 1\"},\"name\":\"execute_sql\"}");
    assert_eq!(wire[5]["content"], "late note");
}

/// A server that returns token ids (vLLM's `return_token_ids`, as `harness-s serve` does)
/// and names its weights: the turn carries the server's sampled ids, the fingerprint of the
/// prompt ids it sampled from, and the policy reports the named checkpoint.
#[tokio::test]
async fn returned_token_ids_give_the_prompt_fingerprint_and_the_named_checkpoint() {
    let mut body = completion("ab", json!(null));
    body["prompt_token_ids"] = json!([5, 6, 7]);
    body["choices"][0]["token_ids"] = json!([40, 41]);
    let served = Reply { headers: format!("{CHECKPOINT_HEADER}: s3://b/runs/r/checkpoints/step=1\r\n"), ..reply(200, body.to_string()) };
    let server = Server::start(vec![served], false).await;
    let mut c = config(&server.url);
    c.return_token_ids = true;
    let policy = OpenAiPolicy::new(c).unwrap();
    assert_eq!(policy.checkpoint(), "m", "before any reply: the model name");
    let out = policy.chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap();
    assert_eq!(out.token_ids, vec![40, 41]);
    assert_eq!(out.prompt_hash.as_deref(), Some(schemas::prompt_hash(&[5, 6, 7]).as_str()));
    assert_eq!(out.prompt_tokens, 3);
    assert_eq!(policy.checkpoint(), "s3://b/runs/r/checkpoints/step=1", "the weights the server named");
    assert_eq!(server.chat_requests()[0].body["return_token_ids"], true);

    // Without the setting nothing is asked, and a server that names nothing leaves the
    // fingerprint unknown (the learner refuses such turns).
    let server = Server::start(vec![ok("ab")], false).await;
    let policy = OpenAiPolicy::new(config(&server.url)).unwrap();
    let out = policy.chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap();
    assert!(out.prompt_hash.is_none());
    assert!(server.chat_requests()[0].body.get("return_token_ids").is_none());
    assert_eq!(policy.checkpoint(), "m");
}

/// A weight-synced endpoint that answers from other weights (it restarted on its starting
/// ones): the reply is not used, the client asks the server to load the synced weights
/// (`/get_model_info`, then `/update_weights_from_disk`), and the retried call's reply,
/// from the synced weights, is.
#[tokio::test]
async fn a_reply_from_other_weights_than_the_synced_ones_is_retried_after_a_reload() {
    let named = |weights: &str| Reply { headers: format!("{CHECKPOINT_HEADER}: {weights}\r\n"), ..ok("fine") };
    let server = Server::start(vec![named("/models/base.gguf"), named("/s/runs/r/checkpoints/step=1")], false).await;
    let mut c = config(&server.url);
    c.checkpoint = Some("/s/runs/r/checkpoints/step=1".into());
    let policy = OpenAiPolicy::new(c).unwrap();
    assert_eq!(policy.checkpoint(), "/s/runs/r/checkpoints/step=1", "before any reply: the synced checkpoint");
    let out = policy.chat(&user("hi"), &[], &SamplingParams::default()).await.unwrap();
    assert_eq!(out.text, "fine");
    assert_eq!(server.chat_requests().len(), 2, "the stale reply was retried");
    assert!(server.seen.lock().unwrap().iter().any(|s| s.path == "/get_model_info"), "the client asked what the server serves");
    assert_eq!(policy.checkpoint(), "/s/runs/r/checkpoints/step=1");
    assert!(PolicyError::StaleWeights { expected: "a".into(), served: "b".into() }.is_transient());
}

/// A constrained call: refused before any request unless the endpoint speaks harness-s's
/// grammars; sent as `constrain` when it does; an answer that does not echo it (a server
/// that ignored the field) is refused, not used.
#[tokio::test]
async fn a_constrained_call_needs_a_server_that_decodes_the_grammar() {
    let constrained = SamplingParams { constrain: Some(crate::policy::Constrain::HarnessPatch), ..Default::default() };
    let mut echoed = completion("{}", json!(null));
    echoed["constrain"] = json!("harness_patch");
    let server = Server::start(vec![reply(200, echoed.to_string()), ok("{}")], false).await;

    let plain = OpenAiPolicy::new(config(&server.url)).unwrap();
    let err = plain.chat(&user("patch"), &[], &constrained).await.unwrap_err();
    assert!(matches!(err, PolicyError::Config(_)) && err.to_string().contains("harness-s serve"), "{err}");
    assert!(server.chat_requests().is_empty(), "nothing was sent");

    let mut c = config(&server.url);
    c.grammars = true;
    let with = OpenAiPolicy::new(c).unwrap();
    assert_eq!(with.chat(&user("patch"), &[], &constrained).await.unwrap().text, "{}");
    assert_eq!(server.chat_requests()[0].body["constrain"], "harness_patch");
    // The second answer does not echo the grammar: refused, and not retried.
    let err = with.chat(&user("patch"), &[], &constrained).await.unwrap_err();
    assert!(matches!(err, PolicyError::Config(_)) && err.to_string().contains("without decoding"), "{err}");
    assert_eq!(server.chat_requests().len(), 2);
}
