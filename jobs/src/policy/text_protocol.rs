//! The text tool-call protocol, for models and chat templates without native tool calls
//! (e.g. SmolLM2 behind llama.cpp's `chatml` format, which drops `tools` silently, or the
//! native tch backend).
//!
//! This module owns two pure functions: [`instructions`] renders the offered tools and the
//! protocol into text for the system prompt, and [`parse`] turns an assistant reply back
//! into [`ToolCall`]s. The protocol accepts, in any mix and in order of appearance:
//!
//! 1. `Action: {"name": "<tool>", "arguments": {...}}` — one JSON object on the line (a
//!    bare JSON line of that shape, a ```` ```json ```` block, and Hermes-style
//!    `<tool_call>{...}</tool_call>` are read the same way; `"parameters"` is accepted for
//!    `"arguments"`, and a JSON array of such objects is several calls);
//! 2. shorthands, active only when the named tool is offered (mostly the AgentBench DBBench
//!    format): a ```` ```sql ```` fenced block calls `execute_sql` with `{"query": <block>}`,
//!    and a `Final Answer: [...]` line calls `commit_final_answer` with
//!    `{"answers": [...]}` (a JSON list, a Python-style list with single quotes, or a bare
//!    value taken as a one-element list), and the call syntax `tool({...})` of an offered
//!    tool (hook messages show calls that way).
//!
//! ```
//! use jobs::policy::text_protocol;
//! let calls = text_protocol::parse("Let me look.\n```sql\nSELECT 1;\n```", &["execute_sql"], true);
//! assert_eq!(calls[0].name, "execute_sql");
//! assert_eq!(calls[0].args["query"], "SELECT 1;");
//! ```

use serde_json::{json, Map, Value};

use crate::env::{ToolCall, ToolSpec};

/// A shorthand of the protocol: a textual form that stands for one tool's call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shorthand {
    pub form: ShorthandForm,
    /// The tool called; the shorthand is active only when this tool is offered.
    pub tool: &'static str,
    /// The argument that receives the text.
    pub arg: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShorthandForm {
    /// A fenced code block with this language tag; the block's body is the argument.
    Fence(&'static str),
    /// A line starting with this prefix; the rest, read as a list, is the argument.
    ListLine(&'static str),
}

/// The DBBench shorthands (AgentBench's `Action: Operation ```sql``` ` / `Final Answer:`).
pub const SHORTHANDS: [Shorthand; 2] = [
    Shorthand { form: ShorthandForm::Fence("sql"), tool: "execute_sql", arg: "query" },
    Shorthand { form: ShorthandForm::ListLine("Final Answer:"), tool: "commit_final_answer", arg: "answers" },
];

/// The protocol text placed after the system prompt: the tools with their arguments, and how
/// to call them. Deterministic for a given tool list, so a learner can rebuild the prompt.
pub fn instructions(tools: &[ToolSpec]) -> String {
    let mut out = String::from("You can use these tools:\n");
    for tool in tools {
        out.push_str(&format!("- {}: {}", tool.name, tool.description.trim()));
        let args = argument_summary(&tool.parameters);
        if !args.is_empty() {
            out.push_str(&format!(" Arguments: {args}."));
        }
        out.push('\n');
    }
    out.push_str(
        "To call a tool, write one line of the form\n\
         Action: {\"name\": \"<tool name>\", \"arguments\": {<arguments as JSON>}}\n\
         and then stop; the result comes back in the next message.\n",
    );
    let offered: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    for shorthand in SHORTHANDS.iter().filter(|s| offered.contains(&s.tool)) {
        match shorthand.form {
            ShorthandForm::Fence(lang) => out.push_str(&format!(
                "Shorthand: a ```{lang} fenced block calls {} with the block as `{}`, e.g.\n```{lang}\nSELECT count(*) FROM t;\n```\n",
                shorthand.tool, shorthand.arg
            )),
            ShorthandForm::ListLine(prefix) => out.push_str(&format!(
                "Shorthand: a line `{prefix} [\"value\", ...]` calls {} with that list as `{}`, e.g.\n{prefix} [\"42\"]\n",
                shorthand.tool, shorthand.arg
            )),
        }
    }
    out
}

/// Renders calls in the protocol's `Action:` form, for assistant turns that carry calls but
/// no text (an action forced or rewritten by a harness hook).
pub fn render_calls(calls: &[ToolCall]) -> String {
    calls.iter().map(|c| format!("Action: {}", json!({"name": c.name, "arguments": c.args}))).collect::<Vec<_>>().join("\n")
}

/// Reads the tool calls in an assistant reply, in order of appearance. `offered` enables
/// the shorthands of offered tools; `shorthands = false` reads only the explicit JSON forms
/// (used after a native-tools request, where prose such as a ```sql example must not act).
pub fn parse(text: &str, offered: &[&str], shorthands: bool) -> Vec<ToolCall> {
    // (byte offset, call) so that calls of different forms keep their textual order.
    let mut found: Vec<(usize, ToolCall)> = Vec::new();
    let mut consumed: Vec<(usize, usize)> = Vec::new();

    // <tool_call>...</tool_call>
    let mut from = 0;
    while let Some(start) = text[from..].find("<tool_call>").map(|i| i + from) {
        let body_start = start + "<tool_call>".len();
        let end = text[body_start..].find("</tool_call>").map(|i| i + body_start).unwrap_or(text.len());
        for call in calls_from_json_text(&text[body_start..end]) {
            found.push((start, call));
        }
        let stop = (end + "</tool_call>".len()).min(text.len());
        consumed.push((start, stop));
        from = stop;
    }

    // Fenced blocks: ```json with call objects, and the fence shorthands.
    for (start, end, lang, body) in fenced_blocks(text) {
        if overlaps(&consumed, start, end) {
            continue;
        }
        if lang.eq_ignore_ascii_case("json") {
            let calls = calls_from_json_text(body);
            if !calls.is_empty() {
                consumed.push((start, end));
                found.extend(calls.into_iter().map(|c| (start, c)));
                continue;
            }
        }
        if !shorthands {
            continue;
        }
        for shorthand in SHORTHANDS.iter().filter(|s| offered.contains(&s.tool)) {
            if let ShorthandForm::Fence(tag) = shorthand.form {
                if lang.eq_ignore_ascii_case(tag) && !body.trim().is_empty() {
                    let args = Value::Object(Map::from_iter([(shorthand.arg.to_string(), Value::String(body.trim().to_string()))]));
                    found.push((start, ToolCall { name: shorthand.tool.to_string(), args }));
                    consumed.push((start, end));
                }
            }
        }
    }

    // Call syntax `tool({json})` of an offered tool (hook messages show calls this way).
    if shorthands {
        for name in offered {
            let pattern = format!("{name}(");
            let mut from = 0;
            while let Some(at) = text[from..].find(&pattern).map(|i| i + from) {
                from = at + pattern.len();
                // A longer identifier ending in this name (`my_execute_sql(`) is not this tool.
                let preceded = text[..at].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_');
                if preceded || overlaps(&consumed, at, from) {
                    continue;
                }
                let mut stream = serde_json::Deserializer::from_str(&text[from..]).into_iter::<Value>();
                if let Some(Ok(args @ Value::Object(_))) = stream.next() {
                    let end = from + stream.byte_offset();
                    if text[end..].trim_start().starts_with(')') {
                        found.push((at, ToolCall { name: name.to_string(), args }));
                        consumed.push((at, end));
                    }
                }
            }
        }
    }

    // Line forms: `Action: {json}`, bare JSON call lines, and the list-line shorthands.
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let line_start = offset;
        offset += line.len();
        if overlaps(&consumed, line_start, offset) {
            continue;
        }
        let trimmed = line.trim();
        let json_part = trimmed.strip_prefix("Action:").map(str::trim).unwrap_or(trimmed);
        if json_part.starts_with('{') || json_part.starts_with('[') {
            let calls = calls_from_json_text(json_part);
            if !calls.is_empty() {
                found.extend(calls.into_iter().map(|c| (line_start, c)));
                continue;
            }
        }
        if !shorthands {
            continue;
        }
        for shorthand in SHORTHANDS.iter().filter(|s| offered.contains(&s.tool)) {
            if let ShorthandForm::ListLine(prefix) = shorthand.form {
                if let Some(pos) = find_ignore_case(trimmed, prefix) {
                    let rest = trimmed[pos + prefix.len()..].trim();
                    let args = Value::Object(Map::from_iter([(shorthand.arg.to_string(), parse_list(rest))]));
                    found.push((line_start, ToolCall { name: shorthand.tool.to_string(), args }));
                }
            }
        }
    }

    found.sort_by_key(|(at, _)| *at);
    found.into_iter().map(|(_, c)| c).collect()
}

/// A one-line summary of a JSON-Schema arguments object: `query (string, required)`.
fn argument_summary(schema: &Value) -> String {
    let Some(props) = schema.get("properties").and_then(Value::as_object) else {
        return String::new();
    };
    let required: Vec<&str> =
        schema.get("required").and_then(Value::as_array).map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    props
        .iter()
        .map(|(name, prop)| {
            let ty = prop.get("type").and_then(Value::as_str).unwrap_or("any");
            let ty = if ty == "array" {
                let item = prop.pointer("/items/type").and_then(Value::as_str).unwrap_or("any");
                format!("list of {item}")
            } else {
                ty.to_string()
            };
            if required.contains(&name.as_str()) {
                format!("`{name}` ({ty}, required)")
            } else {
                format!("`{name}` ({ty})")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Calls in a JSON text: an object `{"name", "arguments"|"parameters"}` or an array of them.
fn calls_from_json_text(text: &str) -> Vec<ToolCall> {
    let Ok(value) = serde_json::from_str::<Value>(text.trim()) else {
        return Vec::new();
    };
    let items = match value {
        Value::Array(items) => items,
        other => vec![other],
    };
    items.into_iter().filter_map(call_from_value).collect()
}

fn call_from_value(value: Value) -> Option<ToolCall> {
    let obj = value.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let args = obj.get("arguments").or_else(|| obj.get("parameters"))?.clone();
    // Some models write the arguments as a JSON string, as the OpenAI wire format does.
    let args = match args {
        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        other => other,
    };
    Some(ToolCall { name, args })
}

/// ```` ```lang\nbody``` ```` blocks: (start, end, lang, body). An unclosed block runs to the
/// end of the text, because generation often stops at a stop sequence or the token limit.
fn fenced_blocks(text: &str) -> Vec<(usize, usize, &str, &str)> {
    let mut blocks = Vec::new();
    let mut from = 0;
    while let Some(start) = text[from..].find("```").map(|i| i + from) {
        let after = start + 3;
        let line_end = text[after..].find('\n').map(|i| i + after).unwrap_or(text.len());
        let lang = text[after..line_end].trim();
        let body_start = (line_end + 1).min(text.len());
        let (body_end, end) = match text[body_start..].find("```") {
            Some(i) => (body_start + i, body_start + i + 3),
            None => (text.len(), text.len()),
        };
        blocks.push((start, end, lang, &text[body_start..body_end]));
        from = end;
        if from >= text.len() {
            break;
        }
    }
    blocks
}

fn overlaps(ranges: &[(usize, usize)], start: usize, end: usize) -> bool {
    ranges.iter().any(|&(s, e)| start < e && s < end)
}

fn find_ignore_case(haystack: &str, needle: &str) -> Option<usize> {
    haystack.to_ascii_lowercase().find(&needle.to_ascii_lowercase())
}

/// Reads an answer list leniently: JSON, a Python-style list (single quotes, `None`), or a
/// bare value as a one-element list. Values are kept as JSON values; the grader normalises.
fn parse_list(text: &str) -> Value {
    let text = text.trim().trim_end_matches('.').trim();
    if let Ok(v @ Value::Array(_)) = serde_json::from_str::<Value>(text) {
        return v;
    }
    if let Some(inner) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        return Value::Array(split_python_list(inner).into_iter().map(Value::String).collect());
    }
    if text.is_empty() {
        return Value::Array(vec![]);
    }
    Value::Array(vec![Value::String(unquote(text).to_string())])
}

/// Splits `'a', "b, c", 3` on commas outside quotes.
fn split_python_list(inner: &str) -> Vec<String> {
    let mut items = Vec::new();
    let mut current = String::new();
    let mut quote: Option<char> = None;
    for ch in inner.chars() {
        match (quote, ch) {
            (None, '\'' | '"') => {
                quote = Some(ch);
                current.push(ch);
            }
            (Some(q), c) if c == q => {
                quote = None;
                current.push(ch);
            }
            (None, ',') => {
                items.push(std::mem::take(&mut current));
            }
            _ => current.push(ch),
        }
    }
    if !current.trim().is_empty() || !items.is_empty() {
        items.push(current);
    }
    items.into_iter().map(|s| unquote(s.trim()).to_string()).collect()
}

fn unquote(s: &str) -> &str {
    for q in ['\'', '"'] {
        if let Some(inner) = s.strip_prefix(q).and_then(|t| t.strip_suffix(q)) {
            return inner;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const DB_TOOLS: [&str; 2] = ["execute_sql", "commit_final_answer"];

    fn tool(name: &str, params: Value) -> ToolSpec {
        ToolSpec { name: name.into(), description: format!("{name} tool."), parameters: params }
    }

    #[test]
    fn sql_fence_becomes_execute_sql() {
        let calls = parse("Action: Operation\n```sql\nSELECT count(*) FROM `t` WHERE age > 30;\n```\n", &DB_TOOLS, true);
        assert_eq!(
            calls,
            vec![ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT count(*) FROM `t` WHERE age > 30;"}) }]
        );
    }

    #[test]
    fn unclosed_fence_runs_to_end() {
        let calls = parse("```sql\nSELECT 1", &DB_TOOLS, true);
        assert_eq!(calls[0].args["query"], "SELECT 1");
    }

    #[test]
    fn final_answer_forms() {
        let json_list = parse("Action: Answer\nFinal Answer: [\"March 19, 1998\"]", &DB_TOOLS, true);
        assert_eq!(json_list[0].name, "commit_final_answer");
        assert_eq!(json_list[0].args, json!({"answers": ["March 19, 1998"]}));
        let python = parse("Final Answer: ['a, b', 'c', 3]", &DB_TOOLS, true);
        assert_eq!(python[0].args, json!({"answers": ["a, b", "c", "3"]}));
        let bare = parse("final answer: 42.", &DB_TOOLS, true);
        assert_eq!(bare[0].args, json!({"answers": ["42"]}));
        let numbers = parse("Final Answer: [2, 3.5]", &DB_TOOLS, true);
        assert_eq!(numbers[0].args, json!({"answers": [2, 3.5]}));
    }

    #[test]
    fn shorthands_need_the_tool_offered() {
        assert!(parse("```sql\nSELECT 1;\n```\nFinal Answer: [1]", &["other"], true).is_empty());
    }

    #[test]
    fn json_forms_and_order() {
        let text = "First\nAction: {\"name\": \"execute_sql\", \"arguments\": {\"query\": \"SELECT 2\"}}\n\
                    <tool_call>{\"name\": \"commit_final_answer\", \"arguments\": \"{\\\"answers\\\": [\\\"2\\\"]}\"}</tool_call>\n\
                    ```json\n[{\"name\": \"lookup\", \"parameters\": {\"k\": 1}}]\n```\n";
        let calls = parse(text, &DB_TOOLS, true);
        let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["execute_sql", "commit_final_answer", "lookup"]);
        assert_eq!(calls[1].args, json!({"answers": ["2"]}), "string arguments are decoded");
        assert_eq!(calls[2].args, json!({"k": 1}));
    }

    #[test]
    fn without_shorthands_only_json_forms_act() {
        let text = "For example:\n```sql\nSELECT 1;\n```\nFinal Answer: [1]\n{\"name\": \"execute_sql\", \"arguments\": {\"query\": \"SELECT 3\"}}";
        let calls = parse(text, &DB_TOOLS, false);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].args["query"], "SELECT 3");
    }

    #[test]
    fn call_syntax_of_offered_tools() {
        let calls = parse("I will call commit_final_answer({\"answers\": [\"2\"]}) now.", &DB_TOOLS, true);
        assert_eq!(calls, vec![ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["2"]}) }]);
        assert!(parse("my_execute_sql({\"query\": \"x\"})", &DB_TOOLS, true).is_empty());
        assert!(parse("execute_sql({\"query\": \"x\"}", &DB_TOOLS, true).is_empty(), "no closing parenthesis");
        assert!(parse("commit_final_answer({\"answers\": []})", &DB_TOOLS, false).is_empty(), "text mode only");
    }

    #[test]
    fn prose_is_no_call() {
        assert!(parse("The output is 2. {not json}", &DB_TOOLS, true).is_empty());
    }

    #[test]
    fn instructions_list_tools_and_active_shorthands() {
        let tools = [
            tool("execute_sql", json!({"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]})),
            tool(
                "commit_final_answer",
                json!({"type": "object", "properties": {"answers": {"type": "array", "items": {"type": "string"}}}}),
            ),
        ];
        let text = instructions(&tools);
        assert!(text.contains("- execute_sql: execute_sql tool. Arguments: `query` (string, required)."), "{text}");
        assert!(text.contains("`answers` (list of string)"), "{text}");
        assert!(text.contains("```sql") && text.contains("Final Answer:"), "{text}");
        let only_sql = instructions(&tools[..1]);
        assert!(!only_sql.contains("Final Answer:"), "{only_sql}");
        // What instructions teach, parse reads.
        let rendered = render_calls(&[ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT 9"}) }]);
        assert_eq!(parse(&rendered, &DB_TOOLS, false)[0].args["query"], "SELECT 9");
    }
}
