//! The patch grammar ([`jobs::policy::Constrain::HarnessPatch`]): the replies a
//! constrained editor may write (Harness-R1 with small editors). A reply is one JSON diff of the evolve editor's format that adds one entry to
//! one component, in a fixed layout with free text where the entry has text:
//!
//! ```text
//! {"prompt_rules": [{"slot": "<slot>", "text": "<text>"}]}
//! {"skills" | "context": [{"name": "<name>", "text": "<text>"}]}
//! {"memory": [{"key": "<name>", "text": "<text>"}]}
//! {"hooks": [{"id": "<name>", "event": "<event>", "condition": "<condition>", "action": "warn", "message": "<text>"}]}
//! {"examples": [{"name": "<name>", "turns": [{"role": "user", "text": "<text>"}, {"role": "assistant", "text": "<text>"}]}]}
//! ```
//!
//! `<name>` is `[a-z][a-z0-9-]{0,23}`; `<text>` is 1 to [`MAX_TEXT`] characters without
//! quotes, backslashes or control characters; slots, events and conditions are the
//! spec's own names. Every reply the grammar completes parses and validates against any
//! parent (a test checks each template on parents that already hold its names, which
//! [`jobs::evolve::editor::apply_diff`] suffixes), so a constrained editor's patches are valid by
//! construction and its reward is the rerun's alone.
//!
//! The grammar is a handful of templates run as a small NFA over characters: a state is
//! the set of (template, segment, offset) positions still alive. A decoder asks whether a
//! token's text keeps a state alive ([`PatchGrammar::advance`]) and whether the state may
//! end ([`PatchGrammar::is_complete`]).

use jobs::harness::condition::event_name;

/// Characters of one free-text field at most.
pub const MAX_TEXT: u16 = 160;
/// Characters of one name at most.
pub const MAX_NAME: u16 = 24;

#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Lit(String),
    Text,
    Name,
}

/// The grammar's templates.
#[derive(Debug, Clone)]
pub struct PatchGrammar {
    templates: Vec<Vec<Seg>>,
}

/// Where a partial reply can be in the grammar; empty when it left it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GrammarState {
    at: Vec<(u16, u16, u16)>,
}

impl GrammarState {
    /// Whether no template matches any more.
    pub fn is_dead(&self) -> bool {
        self.at.is_empty()
    }
}

const SLOTS: [&str; 5] = ["system", "task_preamble", "action_guidance", "answer_format", "error_recovery"];
const EVENTS: [&str; 3] = ["episode_start", "before_decision", "after_tool"];
const CONDITIONS: [&str; 5] = ["always", "last_action_failed", "repeated_action", "no_answer_committed", "text_only_reply"];

impl Default for PatchGrammar {
    fn default() -> Self {
        Self::new()
    }
}

impl PatchGrammar {
    pub fn new() -> Self {
        use Seg::{Name, Text};
        let lit = |s: &str| Seg::Lit(s.to_string());
        let mut templates = vec![];
        for slot in SLOTS {
            templates.push(vec![lit(&format!(r#"{{"prompt_rules": [{{"slot": "{slot}", "text": ""#)), Text, lit(r#""}]}"#)]);
        }
        for (component, key) in [("skills", "name"), ("context", "name"), ("memory", "key")] {
            templates.push(vec![lit(&format!(r#"{{"{component}": [{{"{key}": ""#)), Name, lit(r#"", "text": ""#), Text, lit(r#""}]}"#)]);
        }
        // Each condition at the events where it can be evaluated (the validator's table).
        for event in EVENTS {
            for condition in CONDITIONS {
                let at = jobs::harness::condition::predicate(condition).map(|p| p.events.iter().any(|e| event_name(*e) == event));
                if at != Some(true) {
                    continue;
                }
                templates.push(vec![
                    lit(r#"{"hooks": [{"id": ""#),
                    Name,
                    lit(&format!(r#"", "event": "{event}", "condition": "{condition}", "action": "warn", "message": ""#)),
                    Text,
                    lit(r#""}]}"#),
                ]);
            }
        }
        templates.push(vec![
            lit(r#"{"examples": [{"name": ""#),
            Name,
            lit(r#"", "turns": [{"role": "user", "text": ""#),
            Text,
            lit(r#""}, {"role": "assistant", "text": ""#),
            Text,
            lit(r#""}]}]}"#),
        ]);
        PatchGrammar { templates }
    }

    /// The state before any character.
    pub fn start(&self) -> GrammarState {
        GrammarState { at: (0..self.templates.len() as u16).map(|t| (t, 0, 0)).collect() }
    }

    /// The state after `text`; [`GrammarState::is_dead`] when `text` leaves the grammar.
    pub fn advance(&self, state: &GrammarState, text: &str) -> GrammarState {
        let mut at = state.at.clone();
        for c in text.chars() {
            let mut next: Vec<(u16, u16, u16)> = at.iter().filter_map(|&p| self.step(p, c)).collect();
            next.sort_unstable();
            next.dedup();
            at = next;
            if at.is_empty() {
                break;
            }
        }
        GrammarState { at }
    }

    /// Whether the reply may end here (some template is complete).
    pub fn is_complete(&self, state: &GrammarState) -> bool {
        state.at.iter().any(|&(t, s, _)| s as usize == self.templates[t as usize].len())
    }

    /// Whether `text` keeps `state` in the grammar: `!advance(state, text).is_dead()`,
    /// without allocating (a decoder asks this of every token at every step).
    pub fn accepts(&self, state: &GrammarState, text: &str) -> bool {
        state.at.iter().any(|&p| text.chars().try_fold(p, |p, c| self.step(p, c)).is_some())
    }

    /// Position (t, s, n) after character `c`, when alive. From one position each
    /// character leads to at most one: a field ends only at a quote, which nothing inside
    /// a field may hold.
    fn step(&self, (t, s, n): (u16, u16, u16), c: char) -> Option<(u16, u16, u16)> {
        let segs = &self.templates[t as usize];
        let seg = segs.get(s as usize)?;
        match seg {
            Seg::Lit(l) => (c.is_ascii() && l.as_bytes().get(n as usize) == Some(&(c as u8))).then(|| normal(segs, t, s, n + 1)),
            Seg::Text | Seg::Name => {
                let (max, ok) = match seg {
                    Seg::Text => (MAX_TEXT, c != '"' && c != '\\' && !c.is_control()),
                    _ => (MAX_NAME, c.is_ascii_lowercase() || (n > 0 && (c.is_ascii_digit() || c == '-'))),
                };
                if c == '"' && n > 0 {
                    // The field ends; the next literal starts with this quote.
                    self.step((t, s + 1, 0), c)
                } else if ok && n < max {
                    Some((t, s, n + 1))
                } else {
                    None
                }
            }
        }
    }
}

/// (t, s, n) with a finished literal moved on to the next segment.
fn normal(segs: &[Seg], t: u16, s: u16, n: u16) -> (u16, u16, u16) {
    match &segs[s as usize] {
        Seg::Lit(l) if n as usize == l.len() => (t, s + 1, 0),
        _ => (t, s, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jobs::evolve::editor::patch_from_reply;
    use jobs::harness::ValidateOptions;
    use schemas::HarnessSpec;

    /// Every template with its fields filled in.
    fn filled(g: &PatchGrammar) -> Vec<String> {
        g.templates
            .iter()
            .map(|segs| {
                segs.iter()
                    .map(|s| match s {
                        Seg::Lit(l) => l.clone(),
                        Seg::Text => "Commit the value from the last result.".into(),
                        Seg::Name => "commit-now".into(),
                    })
                    .collect()
            })
            .collect()
    }

    fn spec(v: serde_json::Value) -> HarnessSpec {
        jobs::harness::spec_from_value("test", &v, &Default::default()).unwrap()
    }

    #[test]
    fn every_reply_the_grammar_completes_is_a_valid_patch() {
        let g = PatchGrammar::new();
        let opts =
            ValidateOptions { tools: Some(vec!["execute_sql".into(), "commit_final_answer".into()]), harness_actions: false, base: false };
        // Parents that already hold every name the filled templates use.
        let parents = [
            HarnessSpec::h0(),
            spec(serde_json::json!({"id": "s1",
                "hooks": [{"id": "commit-now", "event": "after_tool", "condition": "always", "action": "warn", "message": "x"}],
                "skills": [{"name": "commit-now", "text": "x"}], "context": [{"name": "commit-now", "text": "x"}],
                "memory": [{"key": "commit-now", "text": "x"}],
                "examples": [{"name": "commit-now", "turns": [{"role": "user", "text": "q"}, {"role": "assistant", "text": "a"}]}]})),
        ];
        for reply in filled(&g) {
            let s = g.advance(&g.start(), &reply);
            assert!(g.is_complete(&s), "{reply}");
            for parent in &parents {
                patch_from_reply(parent, &reply, "c1", 1, "d", &opts).unwrap_or_else(|e| panic!("{reply} on {}: {e}", parent.id));
            }
        }
    }

    #[test]
    fn the_grammar_refuses_what_leaves_it() {
        let g = PatchGrammar::new();
        let s = g.advance(&g.start(), r#"{"prompt_rules": [{"slot": "answer_format", "text": "#);
        assert!(!s.is_dead() && !g.is_complete(&s));
        assert!(g.advance(&s, "\"Say it.\"}]").at.len() == 1);
        assert!(g.advance(&s, "\"\"").is_dead(), "empty text");
        assert!(g.advance(&s, "\"a\\n\"").is_dead(), "escapes");
        assert!(g.advance(&g.start(), "Here is").is_dead());
        assert!(g.advance(&g.start(), r#"{"prompt_rules": [{"slot": "teatime""#).is_dead());
        assert!(g.advance(&g.start(), r#"{"hooks": [{"id": "Bad"#).is_dead(), "names are lower case");
        let long = format!(r#"{{"memory": [{{"key": "k", "text": "{}"#, "x".repeat(MAX_TEXT as usize + 1));
        assert!(g.advance(&g.start(), &long).is_dead());
        // `accepts` answers as `advance` does, from every state a reply passes through.
        for reply in filled(&g) {
            let mut state = g.start();
            for (i, c) in reply.char_indices() {
                for text in ["\"", "\"}]}", "a", "Commit", "\\", " \"", "-1", "é", "\"}, {\"role", &reply[i..]] {
                    assert_eq!(g.accepts(&state, text), !g.advance(&state, text).is_dead(), "{text:?} after {:?}", &reply[..i]);
                }
                state = g.advance(&state, c.encode_utf8(&mut [0; 4]));
            }
        }
        // Split anywhere, the same text reaches the same state.
        let reply = &filled(&g)[7];
        let (a, b) = reply.split_at(23);
        assert_eq!(g.advance(&g.advance(&g.start(), a), b), g.advance(&g.start(), reply));
    }
}
