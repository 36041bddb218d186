//! Edits between two harness specs (`harness-s harness diff A B`): which components were
//! added, removed or changed. Lists of hooks, skills, context, memory and tool-view entries
//! are matched by their id / name / key, so that reordering is not reported as an edit and
//! a changed hook shows as one change, not a removal plus an addition.

use std::fmt;

use serde_json::Value;

use schemas::HarnessSpec;

/// What happened at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EditKind {
    Added,
    Removed,
    Changed,
}

/// One edit: `+ hooks[id=low-budget]: {...}`, `~ direction: "a" -> "b"`.
#[derive(Debug, Clone, PartialEq)]
pub struct Edit {
    pub kind: EditKind,
    pub path: String,
    pub old: Option<Value>,
    pub new: Option<Value>,
}

impl fmt::Display for Edit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<Value>| v.as_ref().map(|v| v.to_string()).unwrap_or_default();
        match self.kind {
            EditKind::Added => write!(f, "+ {}: {}", self.path, show(&self.new)),
            EditKind::Removed => write!(f, "- {}: {}", self.path, show(&self.old)),
            EditKind::Changed => write!(f, "~ {}: {} -> {}", self.path, show(&self.old), show(&self.new)),
        }
    }
}

/// Edits that turn spec `a` into spec `b`, in document order.
pub fn diff_specs(a: &HarnessSpec, b: &HarnessSpec) -> Vec<Edit> {
    let to_value = |s: &HarnessSpec| serde_json::to_value(s).unwrap_or(Value::Null);
    diff_values(&to_value(a), &to_value(b))
}

/// Edits between two JSON values (specs that do not validate can still be compared).
pub fn diff_values(a: &Value, b: &Value) -> Vec<Edit> {
    let mut out = Vec::new();
    walk("", a, b, &mut out);
    out
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn walk(path: &str, a: &Value, b: &Value, out: &mut Vec<Edit>) {
    if a == b {
        return;
    }
    match (a, b) {
        (Value::Object(ma), Value::Object(mb)) => {
            let keys: std::collections::BTreeSet<&String> = ma.keys().chain(mb.keys()).collect();
            for k in keys {
                let p = join(path, k);
                let empty = Value::Array(vec![]);
                match (ma.get(k), mb.get(k)) {
                    (Some(va), Some(vb)) => walk(&p, va, vb, out),
                    // A component list that appears or disappears shows entry by entry.
                    (Some(va @ Value::Array(_)), None) => walk(&p, va, &empty, out),
                    (None, Some(vb @ Value::Array(_))) => walk(&p, &empty, vb, out),
                    (Some(va), None) => out.push(Edit { kind: EditKind::Removed, path: p, old: Some(va.clone()), new: None }),
                    (None, Some(vb)) => out.push(Edit { kind: EditKind::Added, path: p, old: None, new: Some(vb.clone()) }),
                    (None, None) => {}
                }
            }
        }
        (Value::Array(la), Value::Array(lb)) => match list_key(la, lb) {
            Some(key) => keyed(path, key, la, lb, out),
            None => {
                for i in 0..la.len().max(lb.len()) {
                    let p = format!("{path}[{i}]");
                    match (la.get(i), lb.get(i)) {
                        (Some(x), Some(y)) => walk(&p, x, y, out),
                        (Some(x), None) => out.push(Edit { kind: EditKind::Removed, path: p, old: Some(x.clone()), new: None }),
                        (None, Some(y)) => out.push(Edit { kind: EditKind::Added, path: p, old: None, new: Some(y.clone()) }),
                        (None, None) => {}
                    }
                }
            }
        },
        _ => out.push(Edit { kind: EditKind::Changed, path: path.to_string(), old: Some(a.clone()), new: Some(b.clone()) }),
    }
}

/// The field that identifies list entries, if every entry of both lists has a distinct one.
fn list_key(la: &[Value], lb: &[Value]) -> Option<&'static str> {
    ["id", "name", "key"].into_iter().find(|k| {
        [la, lb].iter().all(|list| {
            let ids: Vec<&str> = list.iter().filter_map(|v| v.get(*k).and_then(Value::as_str)).collect();
            let mut unique = ids.clone();
            unique.sort_unstable();
            unique.dedup();
            ids.len() == list.len() && unique.len() == ids.len()
        }) && !(la.is_empty() && lb.is_empty())
    })
}

fn keyed(path: &str, key: &str, la: &[Value], lb: &[Value], out: &mut Vec<Edit>) {
    let id = |v: &Value| v.get(key).and_then(Value::as_str).unwrap_or_default().to_string();
    for va in la {
        let p = format!("{path}[{key}={}]", id(va));
        match lb.iter().find(|vb| id(vb) == id(va)) {
            Some(vb) => walk(&p, va, vb, out),
            None => out.push(Edit { kind: EditKind::Removed, path: p, old: Some(va.clone()), new: None }),
        }
    }
    for vb in lb {
        if !la.iter().any(|va| id(va) == id(vb)) {
            let p = format!("{path}[{key}={}]", id(vb));
            out.push(Edit { kind: EditKind::Added, path: p, old: None, new: Some(vb.clone()) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(v: Value) -> HarnessSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn identical_specs_have_no_edits() {
        assert!(diff_specs(&HarnessSpec::h0(), &HarnessSpec::h0()).is_empty());
    }

    #[test]
    fn edits_match_hooks_by_id_and_show_each_change() {
        let a = spec(json!({"id": "s1", "parent": "h0", "generation": 1,
        "prompt_rules": [{"slot": "system", "text": "a"}],
        "hooks": [
            {"id": "low", "event": "after_tool", "condition": "remaining_steps_lte", "action": "warn", "message": "m", "parameters": {"threshold": 3}},
            {"id": "gone", "event": "after_tool", "condition": "always", "action": "warn", "message": "x"}
        ]}));
        let b = spec(json!({"id": "s2", "parent": "s1", "generation": 2, "direction": "commit earlier",
        "prompt_rules": [{"slot": "system", "text": "a"}, {"slot": "action_guidance", "text": "b"}],
        "hooks": [
            {"id": "new", "event": "before_decision", "condition": "text_only_reply", "action": "warn", "message": "call a tool"},
            {"id": "low", "event": "after_tool", "condition": "remaining_steps_lte", "action": "warn", "message": "m", "parameters": {"threshold": 2}}
        ]}));
        let lines: Vec<String> = diff_specs(&a, &b).iter().map(|e| e.to_string()).collect();
        // Keys in alphabetical order; list entries in the old spec's order, additions last.
        assert_eq!(lines, vec![
            "+ direction: \"commit earlier\"",
            "~ generation: 1 -> 2",
            "~ hooks[id=low].parameters.threshold: 3 -> 2",
            "- hooks[id=gone]: {\"action\":\"warn\",\"condition\":\"always\",\"event\":\"after_tool\",\"id\":\"gone\",\"message\":\"x\"}",
            "+ hooks[id=new]: {\"action\":\"warn\",\"condition\":\"text_only_reply\",\"event\":\"before_decision\",\"id\":\"new\",\"message\":\"call a tool\"}",
            "~ id: \"s1\" -> \"s2\"",
            "~ parent: \"h0\" -> \"s1\"",
            "+ prompt_rules[1]: {\"slot\":\"action_guidance\",\"text\":\"b\"}",
        ]);
    }

    #[test]
    fn a_new_component_list_shows_each_entry() {
        let a = spec(json!({"id": "h0"}));
        let b = spec(json!({"id": "h0", "hooks": [
            {"id": "x", "event": "after_tool", "condition": "always", "action": "warn", "message": "1"},
            {"id": "y", "event": "after_tool", "condition": "always", "action": "warn", "message": "2"}
        ]}));
        let paths: Vec<String> = diff_specs(&a, &b).iter().map(|e| format!("{:?} {}", e.kind, e.path)).collect();
        assert_eq!(paths, vec!["Added hooks[id=x]", "Added hooks[id=y]"]);
        let back: Vec<String> = diff_specs(&b, &a).iter().map(|e| format!("{:?} {}", e.kind, e.path)).collect();
        assert_eq!(back, vec!["Removed hooks[id=x]", "Removed hooks[id=y]"]);
    }

    #[test]
    fn tool_view_entries_match_by_name() {
        let a = spec(json!({"id": "a", "tool_view": {"tools": [{"name": "x"}, {"name": "y"}]}}));
        let b = spec(json!({"id": "a", "tool_view": {"tools": [{"name": "y"}, {"name": "x", "description": "d"}]}}));
        let lines: Vec<String> = diff_specs(&a, &b).iter().map(|e| e.to_string()).collect();
        assert_eq!(lines, vec!["+ tool_view.tools[name=x].description: \"d\""]);
    }
}
