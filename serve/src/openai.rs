//! The OpenAI wire format: requests as they arrive, checked field by field, and the
//! responses built from a native generation. Pure functions; the handlers in `lib.rs` do
//! the IO.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use jobs::env::{ToolCall, ToolSpec};
use jobs::policy::{Message, SamplingParams};
use native::infer::sampler::{Finish, Generation};
use schemas::Role;

/// A request the server refuses, with the field it names (HTTP 400, or 404 for a model).
#[derive(Debug, Clone, PartialEq)]
pub struct BadRequest {
    pub status: u16,
    pub param: Option<String>,
    pub message: String,
    /// The OpenAI error code (`context_length_exceeded`); a 404's is `model_not_found`.
    pub code: Option<&'static str>,
}

impl BadRequest {
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        BadRequest { status: 400, param: Some(param.to_string()), message: format!("{param}: {}", message.into()), code: None }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> Value {
        let kind = if self.status == 404 { "not_found_error" } else { "invalid_request_error" };
        let code = if self.status == 404 { Some("model_not_found") } else { self.code };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": code}})
    }
}

/// Reads a body as one JSON object.
pub fn body(bytes: &[u8]) -> Result<Value, BadRequest> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(BadRequest { status: 400, param: None, message: "the body must be a JSON object".into(), code: None }),
        Err(e) => Err(BadRequest { status: 400, param: None, message: format!("the body is not valid JSON: {e}"), code: None }),
    }
}

/// The top-level fields each endpoint honours (besides `user`, an end-user tag that changes
/// nothing in the reply).
pub const SAMPLING_FIELDS: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "stop",
    "n",
    "stream",
    "return_token_ids",
    "constrain",
    "user",
];
pub const CHAT_FIELDS: &[&str] = &["messages", "tools", "tool_choice", "logprobs", "top_logprobs"];
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo"];

/// Fields other servers take that this one does not honour, accepted only at the value that
/// changes nothing (the API's default).
fn is_default(field: &str, v: &Value) -> bool {
    match field {
        "presence_penalty" | "frequency_penalty" | "repetition_penalty" => v.as_f64() == Some(0.0),
        "logit_bias" => v.as_object().is_some_and(|m| m.is_empty()),
        "best_of" => v.as_u64() == Some(1),
        "suffix" => v.as_str() == Some(""),
        "response_format" => v.get("type").and_then(Value::as_str) == Some("text") && v.as_object().is_some_and(|m| m.len() == 1),
        "parallel_tool_calls" => v.as_bool() == Some(true),
        _ => false,
    }
}

/// Refuses every field of `v` that `known` does not list (a field a server ignores changes
/// the reply the client expects without a word): 400 naming it, unless it is null or holds
/// the value that changes nothing.
pub fn only_known(v: &Value, known: &[&[&str]]) -> Result<(), BadRequest> {
    let Some(obj) = v.as_object() else { return Ok(()) };
    for (k, val) in obj {
        if val.is_null() || known.iter().any(|set| set.contains(&k.as_str())) || is_default(k, val) {
            continue;
        }
        return Err(BadRequest::field(k, "is not supported by this server (it would be ignored); leave it out"));
    }
    Ok(())
}

/// Deserialises a request object into `T` ([`only_known`] refuses the fields no request type
/// of the endpoint reads); errors name the field's path.
pub fn parse<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, BadRequest> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            BadRequest { status: 400, param: None, message: format!("not a valid request: {inner}"), code: None }
        } else {
            BadRequest::field(&path, inner.to_string())
        }
    })
}

/// `"text"` or `[{"type": "text", "text": ...}]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Vec<WireToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct WireToolCall {
    #[serde(default)]
    pub id: Option<String>,
    pub function: WireFunction,
}

#[derive(Debug, Deserialize)]
pub struct WireFunction {
    pub name: String,
    /// A JSON string (the OpenAI form) or an object.
    #[serde(default)]
    pub arguments: Value,
}

#[derive(Debug, Deserialize)]
pub struct ToolDef {
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionDef,
}

fn function_type() -> String {
    "function".into()
}

#[derive(Debug, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub parameters: Option<Value>,
}

/// `"stop"` or `["a", "b"]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The sampling fields chat and text completions share (read from the same object as the
/// endpoint's own request type).
#[derive(Debug, Deserialize)]
pub struct Sampling {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// Return the sampled token ids as `choices[i].token_ids` and the prompt's as
    /// `prompt_token_ids` (vLLM's request field).
    #[serde(default)]
    pub return_token_ids: Option<bool>,
    /// harness-s's own field: decode in this grammar (`"harness_patch"`: one harness patch,
    /// [`native::infer::grammar`]); the answer echoes it as `constrain`.
    #[serde(default)]
    pub constrain: Option<String>,
}

impl Sampling {
    /// The field that set the reply's limit, for errors about it.
    pub fn limit_field(&self) -> &'static str {
        if self.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub tools: Option<Vec<ToolDef>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
}

/// `"text"`, `["text"]`, or token ids `[1, 2, 3]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// The legacy form: how many top log-probabilities per token (0 = only the sampled one).
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: Option<bool>,
}

/// The most top log-probabilities a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Checks the shared fields; returns the sampling settings. `default_max` is the
/// endpoint's default `max_tokens`; a missing seed draws one (so that two requests
/// without a seed do not sample the same tokens).
/// `served`: the names a request may give as `model` (the served model's, then its loaded
/// LoRA adapters').
pub fn sampling(s: &Sampling, served: &[&str], default_max: u32) -> Result<SamplingParams, BadRequest> {
    let names = served.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    let Some(m) = &s.model else {
        return Err(BadRequest::field("model", format!("is required; this server serves {names}")));
    };
    if !served.contains(&m.as_str()) {
        return Err(BadRequest {
            status: 404,
            param: Some("model".into()),
            message: format!("model: `{m}` is not served here; this server serves {names}"),
            code: None,
        });
    }
    if s.stream == Some(true) {
        return Err(BadRequest::field("stream", "streaming is not supported; send stream=false"));
    }
    if s.n.is_some_and(|n| n != 1) {
        return Err(BadRequest::field("n", "only n=1 is supported; send several requests (the engine batches them)"));
    }
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(BadRequest::field("temperature", format!("must be between 0 and 2, is {temperature}")));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(BadRequest::field("top_p", format!("must be in (0, 1], is {top_p}")));
    }
    let max_tokens = s.max_completion_tokens.or(s.max_tokens).unwrap_or(default_max);
    if max_tokens == 0 {
        return Err(BadRequest::field(s.limit_field(), "must be at least 1"));
    }
    let stop = match &s.stop {
        None => vec![],
        Some(Stop::One(x)) => vec![x.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(|x| x.is_empty()) {
        return Err(BadRequest::field("stop", "give at most 4 non-empty stop strings"));
    }
    let constrain = match s.constrain.as_deref() {
        None => None,
        Some(name) => Some(jobs::policy::Constrain::from_wire(name).ok_or_else(|| {
            BadRequest::field("constrain", format!("`{name}` is not a grammar of this server; it knows `harness_patch`"))
        })?),
    };
    Ok(SamplingParams { temperature, top_p, max_tokens, seed: Some(s.seed.unwrap_or_else(rand::random)), stop, constrain })
}

/// What a request may ask of this server: the model's context and vocabulary, and the
/// server's own cap on reply tokens (`harness-s serve --max-tokens`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub context: u64,
    pub vocab: u64,
    pub max_tokens: u32,
}

/// A request fits the model and the server: its prompt ids are in the vocabulary, its reply
/// is within the server's cap, and prompt and reply fit the context (`max_tokens` beyond it
/// would decode until the context ends, however long that takes). `field` names the reply
/// limit the request set.
pub fn fits(prompt: &[u32], max_tokens: u32, field: &str, limits: Limits) -> Result<(), BadRequest> {
    let Limits { context, vocab, max_tokens: cap } = limits;
    if let Some(id) = prompt.iter().find(|&&id| id as u64 >= vocab) {
        return Err(BadRequest::field("prompt", format!("token id {id} is outside the model's vocabulary of {vocab} tokens")));
    }
    let total = prompt.len() as u64 + max_tokens as u64;
    if total > context {
        // worded and coded as other servers do, so that clients see a context overflow
        let room = context.saturating_sub(prompt.len() as u64);
        let message = format!(
            "the model's maximum context length is {context} tokens; the prompt and this reply ask for {total}: ask for at most {} reply tokens (this server's limit is {cap} per request, `harness-s serve --max-tokens`)",
            room.min(cap as u64)
        );
        return Err(BadRequest { code: Some("context_length_exceeded"), ..BadRequest::field(field, message) });
    }
    if max_tokens > cap {
        return Err(BadRequest::field(
            field,
            format!(
                "{max_tokens} is above this server's limit of {cap} reply tokens per request (`harness-s serve --max-tokens`; the model's context is {context} tokens)"
            ),
        ));
    }
    Ok(())
}

fn content_text(c: &Option<Content>, path: &str, may_be_empty: bool) -> Result<String, BadRequest> {
    match c {
        None if may_be_empty => Ok(String::new()),
        None => Err(BadRequest::field(path, "is required (a string or a list of text parts)")),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => out.push_str(t),
                    ("text", None) => return Err(BadRequest::field(&format!("{path}[{i}].text"), "missing")),
                    (other, _) => {
                        return Err(BadRequest::field(
                            &format!("{path}[{i}].type"),
                            format!("`{other}` content is not supported; only text"),
                        ))
                    }
                }
            }
            Ok(out)
        }
    }
}

/// The conversation as the policy's messages.
pub fn messages(req: &ChatRequest) -> Result<Vec<Message>, BadRequest> {
    if req.messages.is_empty() {
        return Err(BadRequest::field("messages", "must hold at least one message"));
    }
    let mut out = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => {
                return Err(BadRequest::field(&format!("messages[{i}].role"), format!("`{other}` is not system, user, assistant or tool")))
            }
        };
        // only an assistant message that calls tools may come without text
        let calls_tools = role == Role::Assistant && m.tool_calls.as_ref().is_some_and(|c| !c.is_empty());
        let content = content_text(&m.content, &format!("messages[{i}].content"), calls_tools)?;
        if role == Role::Tool && m.tool_call_id.as_deref().is_none_or(|id| id.trim().is_empty()) {
            return Err(BadRequest::field(
                &format!("messages[{i}].tool_call_id"),
                "is required in a tool message: the id of the call it answers",
            ));
        }
        let mut msg = Message::new(role, content);
        if let Some(calls) = &m.tool_calls {
            if role != Role::Assistant {
                return Err(BadRequest::field(&format!("messages[{i}].tool_calls"), "only assistant messages carry tool calls"));
            }
            for (j, c) in calls.iter().enumerate() {
                let args = match &c.function.arguments {
                    Value::String(s) => serde_json::from_str(s).map_err(|e| {
                        BadRequest::field(
                            &format!("messages[{i}].tool_calls[{j}].function.arguments"),
                            format!("is not a JSON object: {e}"),
                        )
                    })?,
                    Value::Null => json!({}),
                    other => other.clone(),
                };
                msg.tool_calls.push(ToolCall { name: c.function.name.clone(), args });
            }
        }
        out.push(msg);
    }
    Ok(out)
}

/// The offered tools (none with `tool_choice: "none"`). The model calls tools through the
/// text protocol and may answer without a call, so a choice that forces one (`"required"`, a
/// named function) is refused rather than quietly not enforced.
pub fn tools(req: &ChatRequest) -> Result<Vec<ToolSpec>, BadRequest> {
    if let Some(choice) = &req.tool_choice {
        match choice.as_str() {
            Some("none") => return Ok(vec![]),
            Some("auto") => {}
            Some("required") => {
                return Err(BadRequest::field(
                    "tool_choice",
                    "\"required\" is not supported: the model calls tools through the text protocol and cannot be forced to; send \"auto\" or \"none\"",
                ))
            }
            _ if choice.is_object() => {
                let name = choice.pointer("/function/name").and_then(Value::as_str).unwrap_or("");
                let offered = req.tools.iter().flatten().any(|t| t.function.name == name);
                let why = if offered {
                    format!("forcing `{name}` is not supported: the model calls tools through the text protocol and cannot be forced to; send \"auto\" or \"none\"")
                } else {
                    format!("names `{name}`, which is not among the request's tools")
                };
                return Err(BadRequest::field("tool_choice", why));
            }
            _ => return Err(BadRequest::field("tool_choice", "must be \"none\" or \"auto\"")),
        }
    }
    let mut out = vec![];
    for (i, t) in req.tools.iter().flatten().enumerate() {
        if t.kind != "function" {
            return Err(BadRequest::field(&format!("tools[{i}].type"), format!("`{}` is not `function`", t.kind)));
        }
        if t.function.name.trim().is_empty() {
            return Err(BadRequest::field(&format!("tools[{i}].function.name"), "must not be empty"));
        }
        out.push(ToolSpec {
            name: t.function.name.clone(),
            description: t.function.description.clone().unwrap_or_default(),
            parameters: t.function.parameters.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
        });
    }
    Ok(out)
}

/// How many top log-probabilities a chat request asks for (0 = none), checked.
pub fn chat_top_logprobs(req: &ChatRequest) -> Result<usize, BadRequest> {
    match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (_, Some(k)) if k > MAX_TOP_LOGPROBS => Err(BadRequest::field("top_logprobs", format!("at most {MAX_TOP_LOGPROBS}, is {k}"))),
        (false, Some(k)) if k > 0 => Err(BadRequest::field("top_logprobs", "needs logprobs=true")),
        (_, k) => Ok(k.unwrap_or(0) as usize),
    }
}

/// The text of every token, for log-probability entries.
pub type Pieces<'a> = &'a dyn Fn(u32) -> String;

fn finish_reason(gen: &Generation, tool_calls: bool) -> &'static str {
    match (gen.finish, tool_calls) {
        (_, true) => "tool_calls",
        (Finish::Stop, _) => "stop",
        (Finish::Length, _) => "length",
    }
}

fn logprob_entry(piece: &dyn Fn(u32) -> String, id: u32, logprob: f32) -> Map<String, Value> {
    let token = piece(id);
    let mut m = Map::new();
    m.insert("token".into(), json!(token));
    m.insert("logprob".into(), json!(logprob));
    m.insert("bytes".into(), json!(token.as_bytes()));
    // the sampled id, as llama.cpp's server sends it
    m.insert("id".into(), json!(id));
    m
}

/// `choices[0].logprobs` of a chat completion.
pub fn chat_logprobs(gen: &Generation, piece: &dyn Fn(u32) -> String) -> Value {
    let content: Vec<Value> = gen
        .tokens
        .iter()
        .zip(&gen.logprobs)
        .enumerate()
        .map(|(i, (&id, &lp))| {
            let mut e = logprob_entry(piece, id, lp);
            let top: Vec<Value> =
                gen.top_logprobs.get(i).into_iter().flatten().map(|&(t, l)| Value::Object(logprob_entry(piece, t, l))).collect();
            e.insert("top_logprobs".into(), Value::Array(top));
            Value::Object(e)
        })
        .collect();
    json!({"content": content})
}

/// Everything a response names besides the generation.
pub struct Meta<'a> {
    pub id: String,
    pub created: u64,
    pub model: &'a str,
    /// The checkpoint that sampled the reply (also in the `x-harness-s-checkpoint` header).
    pub checkpoint: &'a str,
    pub prompt: &'a [u32],
    pub return_token_ids: bool,
    /// The grammar the reply was decoded in, echoed as `constrain`.
    pub constrain: Option<jobs::policy::Constrain>,
}

fn usage(prompt: usize, gen: &Generation) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": gen.tokens.len(), "total_tokens": prompt + gen.tokens.len()})
}

/// A chat completion: the text, the calls read from it by the text protocol (the native
/// model has no tool-call channel), log-probabilities when asked.
pub fn chat_response(meta: &Meta, gen: &Generation, text: &str, calls: &[ToolCall], logprobs: Option<Value>) -> Value {
    let tool_calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"id": format!("call_{}_{i}", meta.id), "type": "function", "function": {"name": c.name, "arguments": c.args.to_string()}}))
        .collect();
    let mut message = json!({"role": "assistant", "content": text});
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls);
    }
    let mut choice = json!({"index": 0, "message": message, "finish_reason": finish_reason(gen, !calls.is_empty()), "logprobs": logprobs});
    let mut body = json!({
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": meta.checkpoint, "choices": [], "usage": usage(meta.prompt.len(), gen),
    });
    if meta.return_token_ids {
        choice["token_ids"] = json!(gen.tokens);
        body["prompt_token_ids"] = json!(meta.prompt);
    }
    if let Some(c) = meta.constrain {
        body["constrain"] = json!(c.wire_name());
    }
    body["choices"] = json!([choice]);
    body
}

/// A text completion; `logprobs` in the legacy form (tokens, token_logprobs, top_logprobs,
/// text_offset) when asked.
pub fn completion_response(meta: &Meta, gen: &Generation, text: &str, logprobs: Option<u32>, piece: &dyn Fn(u32) -> String) -> Value {
    let lp = logprobs.map(|_| {
        let tokens: Vec<String> = gen.tokens.iter().map(|&t| piece(t)).collect();
        let mut offset = 0usize;
        let offsets: Vec<usize> = tokens
            .iter()
            .map(|t| {
                let at = offset;
                offset += t.len();
                at
            })
            .collect();
        let top: Vec<Value> = (0..gen.tokens.len())
            .map(|i| {
                let m: Map<String, Value> = gen.top_logprobs.get(i).into_iter().flatten().map(|&(t, l)| (piece(t), json!(l))).collect();
                Value::Object(m)
            })
            .collect();
        json!({"tokens": tokens, "token_logprobs": gen.logprobs, "top_logprobs": top, "text_offset": offsets})
    });
    let mut choice = json!({"index": 0, "text": text, "finish_reason": finish_reason(gen, false), "logprobs": lp});
    let mut body = json!({
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": meta.checkpoint, "choices": [], "usage": usage(meta.prompt.len(), gen),
    });
    if meta.return_token_ids {
        choice["token_ids"] = json!(gen.tokens);
        body["prompt_token_ids"] = json!(meta.prompt);
    }
    if let Some(c) = meta.constrain {
        body["constrain"] = json!(c.wire_name());
    }
    body["choices"] = json!([choice]);
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generation() -> Generation {
        Generation {
            tokens: vec![5, 6],
            logprobs: vec![-0.5, -1.0],
            finish: Finish::Stop,
            stop_token: Some(2),
            top_logprobs: vec![vec![(5, -0.5), (9, -1.5)], vec![(7, -0.2), (6, -1.0)]],
        }
    }

    #[test]
    fn a_wrong_type_names_its_field() {
        let e =
            parse::<Sampling>(&body(br#"{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}"#).unwrap()).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        let e = parse::<ChatRequest>(&body(br#"{"messages": [{"role": 5}]}"#).unwrap()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"), "{e:?}");
        let e = parse::<ChatRequest>(&body(br#"{"model": "m"}"#).unwrap()).unwrap_err();
        assert!(e.message.contains("messages"), "{e:?}");
        let e = body(b"{not json").unwrap_err();
        assert!(e.param.is_none() && e.message.contains("not valid JSON"), "{e:?}");
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let v = |extra: &str| {
            body(format!(r#"{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#).as_bytes()).unwrap()
        };
        let req = |extra: &str| parse::<ChatRequest>(&v(extra)).unwrap();
        let samp = |extra: &str| parse::<Sampling>(&v(extra)).unwrap();
        for (extra, field) in [
            (r#", "temperature": 3"#, "temperature"),
            (r#", "top_p": 0"#, "top_p"),
            (r#", "max_tokens": 0"#, "max_tokens"),
            (r#", "n": 2"#, "n"),
            (r#", "stream": true"#, "stream"),
            (r#", "constrain": "json""#, "constrain"),
        ] {
            let e = sampling(&samp(extra), &["m"], 16).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{extra}: {e:?}");
        }
        let other = parse::<Sampling>(&body(br#"{"model": "other"}"#).unwrap()).unwrap();
        assert_eq!(sampling(&other, &["m"], 16).unwrap_err().status, 404);
        let none = parse::<Sampling>(&body(br#"{"messages": []}"#).unwrap()).unwrap();
        let e = sampling(&none, &["m"], 16).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("model")), "{e:?}");
        let e = chat_top_logprobs(&req(r#", "top_logprobs": 3"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        assert_eq!(chat_top_logprobs(&req(r#", "logprobs": true, "top_logprobs": 3"#)).unwrap(), 3);
        let s = sampling(&samp(r#", "stop": "\n", "seed": 4, "max_completion_tokens": 7"#), &["m"], 16).unwrap();
        assert_eq!((s.stop, s.seed, s.max_tokens), (vec!["\n".to_string()], Some(4), 7));
        // a request must fit the model and the server: vocabulary, context, reply cap
        let limits = Limits { context: 8, vocab: 50, max_tokens: 6 };
        assert!(fits(&[1, 2], 6, "max_tokens", limits).is_ok());
        let e = fits(&[1, 2], 7, "max_tokens", Limits { max_tokens: 100, ..limits }).unwrap_err();
        assert!(
            e.message.starts_with("max_tokens: the model's maximum context length is 8") && e.message.contains("at most 6"),
            "{}",
            e.message
        );
        assert_eq!((e.status, e.body()["error"]["code"].as_str()), (400, Some("context_length_exceeded")));
        let e = fits(&[1], 7, "max_completion_tokens", limits).unwrap_err();
        assert!(
            e.message.starts_with("max_completion_tokens: 7 is above this server's limit of 6")
                && e.message.contains("--max-tokens")
                && e.message.contains("context is 8"),
            "{}",
            e.message
        );
        let e = fits(&[1, 50], 1, "max_completion_tokens", limits).unwrap_err();
        assert!(e.message.starts_with("prompt: token id 50") && e.message.contains("vocabulary of 50"), "{}", e.message);
        let s = sampling(&samp(r#", "constrain": "harness_patch""#), &["m"], 16).unwrap();
        assert_eq!(s.constrain, Some(jobs::policy::Constrain::HarnessPatch));
    }

    /// A field the server would ignore is a 400 naming it, unless it holds the value that
    /// changes nothing; malformed messages are a 400 naming the message's field.
    #[test]
    fn what_the_server_would_ignore_is_refused_by_name() {
        let known: &[&[&str]] = &[SAMPLING_FIELDS, CHAT_FIELDS];
        for (extra, field) in [
            (r#""response_format": {"type": "json_object"}"#, "response_format"),
            (r#""logit_bias": {"5": 100}"#, "logit_bias"),
            (r#""best_of": 3"#, "best_of"),
            (r#""suffix": "end""#, "suffix"),
            (r#""presence_penalty": 0.5"#, "presence_penalty"),
            (r#""frequency_penalty": 1"#, "frequency_penalty"),
            (r#""colour": "blue""#, "colour"),
        ] {
            let v = body(format!(r#"{{"model": "m", "messages": [], {extra}}}"#).as_bytes()).unwrap();
            let e = only_known(&v, known).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(field)), "{extra}: {e:?}");
        }
        for extra in [
            r#""presence_penalty": 0"#,
            r#""logit_bias": {}"#,
            r#""best_of": 1"#,
            r#""response_format": {"type": "text"}"#,
            r#""suffix": null"#,
            r#""user": "u1""#,
        ] {
            let v = body(format!(r#"{{"model": "m", "messages": [], {extra}}}"#).as_bytes()).unwrap();
            assert!(only_known(&v, known).is_ok(), "{extra}");
        }
        let chat = |json: &str| parse::<ChatRequest>(&body(json.as_bytes()).unwrap()).unwrap();
        let e = messages(&chat(r#"{"messages": [{"role": "user", "content": null}]}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"), "{e:?}");
        let e = messages(&chat(r#"{"messages": [{"role": "user"}]}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"), "{e:?}");
        let e = messages(&chat(r#"{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].tool_call_id"), "{e:?}");
        let tools_json = r#""tools": [{"type": "function", "function": {"name": "execute_sql"}}]"#;
        for (choice, says) in [
            (r#""required""#, "cannot be forced"),
            (r#"{"type": "function", "function": {"name": "execute_sql"}}"#, "cannot be forced"),
            (r#"{"type": "function", "function": {"name": "rm_rf"}}"#, "`rm_rf`, which is not among"),
            (r#""sometimes""#, "none"),
        ] {
            let req = chat(&format!(r#"{{"messages": [], {tools_json}, "tool_choice": {choice}}}"#));
            let e = tools(&req).unwrap_err();
            assert!(e.param.as_deref() == Some("tool_choice") && e.message.contains(says), "{choice}: {e:?}");
        }
        assert_eq!(tools(&chat(&format!(r#"{{"messages": [], {tools_json}, "tool_choice": "auto"}}"#))).unwrap().len(), 1);
    }

    #[test]
    fn history_with_tool_calls_becomes_policy_messages() {
        let req = parse::<ChatRequest>(&body(
            br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "count"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "execute_sql", "arguments": "{\"query\": \"SELECT 1\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "[(1,)]"}],
               "tools": [{"type": "function", "function": {"name": "execute_sql", "parameters": {"type": "object"}}}]}"#,
        ).unwrap())
        .unwrap();
        let m = messages(&req).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].content, "count");
        assert_eq!(m[1].tool_calls[0].args["query"], "SELECT 1");
        assert_eq!(m[2].role, Role::Tool);
        assert_eq!(tools(&req).unwrap()[0].name, "execute_sql");
        let bad = parse::<ChatRequest>(&body(br#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#).unwrap()).unwrap();
        assert_eq!(messages(&bad).unwrap_err().param.as_deref(), Some("messages[0].content[0].type"));
    }

    #[test]
    fn responses_carry_calls_logprobs_and_token_ids() {
        let piece = |id: u32| format!("<{id}>");
        let meta = Meta {
            id: "x".into(),
            created: 1,
            model: "m",
            checkpoint: "ckpt",
            prompt: &[1, 2, 3],
            return_token_ids: true,
            constrain: None,
        };
        let calls = vec![ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT 1"}) }];
        let body = chat_response(&meta, &generation(), "Action: ...", &calls, Some(chat_logprobs(&generation(), &piece)));
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["tool_calls"][0]["function"]["arguments"], r#"{"query":"SELECT 1"}"#);
        assert_eq!(choice["token_ids"], json!([5, 6]));
        assert_eq!(body["prompt_token_ids"], json!([1, 2, 3]));
        assert_eq!(choice["logprobs"]["content"][1]["id"], 6);
        assert_eq!(choice["logprobs"]["content"][1]["top_logprobs"][0]["token"], "<7>");
        assert_eq!(body["usage"]["total_tokens"], 5);
        assert_eq!(body["system_fingerprint"], "ckpt");
        let text = completion_response(&meta, &generation(), "<5><6>", Some(2), &piece);
        assert_eq!(text["choices"][0]["logprobs"]["text_offset"], json!([0, 3]));
        assert_eq!(text["choices"][0]["logprobs"]["top_logprobs"][0]["<9>"], -1.5);
        assert_eq!(text["choices"][0]["finish_reason"], "stop");
    }
}
