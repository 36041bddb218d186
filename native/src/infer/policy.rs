//! The `native` policy backend: a [`Model`] + [`Tokenizer`] in this process behind the
//! [`Policy`] trait. Generation runs on the batching [`Engine`]: concurrent calls (the K
//! rollouts of a group, the episodes of a stage) are decoded together.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use tch::Device;

use crate::infer::engine::{Constraint, Engine, EngineConfig, Request, StopFn};
use crate::infer::grammar::{GrammarState, PatchGrammar};
use crate::infer::sampler::{Finish, GenerateOptions, Generation};
use crate::model::chat::prompt_ids;
use crate::model::tokenizer::Tokenizer;
use crate::model::Model;
use crate::NativeError;
use jobs::env::ToolSpec;
use jobs::policy::Constrain;
use jobs::policy::{FinishReason, Message, Policy, PolicyError, PolicyOutput, SamplingParams};

/// The native backend. Cheap to clone (shares the engine, which owns the model).
#[derive(Clone)]
pub struct NativePolicy {
    engine: Arc<Engine>,
    tokenizer: Arc<Tokenizer>,
    context_limit: u64,
    /// Token ids the model has (prompt ids at or beyond it are refused).
    vocab: u64,
    checkpoint: String,
    /// Each token's text alone, for constrained decoding (built on first use).
    pieces: Arc<OnceLock<Arc<Pieces>>>,
}

impl NativePolicy {
    /// Loads a GGUF file or HF directory; `checkpoint` is recorded on trajectory rows.
    pub fn load(path: &Path, device: Device, engine: EngineConfig) -> Result<Self, NativeError> {
        let (model, tokenizer) = crate::model::loader::load(path, device)?;
        Self::new(model, tokenizer, path.display().to_string(), engine)
    }

    /// Starts a batching engine with `engine`'s settings over `model`.
    pub fn new(model: Model, tokenizer: Tokenizer, checkpoint: String, engine: EngineConfig) -> Result<Self, NativeError> {
        Self::with_tokenizer(model, Arc::new(tokenizer), checkpoint, engine)
    }

    /// [`NativePolicy::new`] with a tokenizer shared with another policy (new weights of
    /// the same model).
    pub fn with_tokenizer(model: Model, tokenizer: Arc<Tokenizer>, checkpoint: String, engine: EngineConfig) -> Result<Self, NativeError> {
        let (context_limit, vocab) = (model.max_positions() as u64, model.vocab_size() as u64);
        let engine = Engine::start(model, engine)?;
        Ok(NativePolicy { engine, tokenizer, context_limit, vocab, checkpoint, pieces: Arc::default() })
    }
}

impl NativePolicy {
    /// The tokenizer the engine's prompts are built with.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Positions the model takes, prompt and reply together.
    pub fn context_limit(&self) -> u64 {
        self.context_limit
    }

    /// Token ids the model has.
    pub fn vocab_size(&self) -> u64 {
        self.vocab
    }

    /// The engine's counters since it started.
    pub fn stats(&self) -> crate::infer::engine::EngineStats {
        self.engine.stats()
    }

    /// Generates after `prompt` on the engine; returns the generation and its text, cut
    /// before the first of `sampling.stop`. `top_logprobs` most likely tokens are recorded
    /// per position when it is not 0.
    pub async fn generate(
        &self,
        prompt: Vec<u32>,
        sampling: &SamplingParams,
        top_logprobs: usize,
    ) -> Result<(Generation, String), PolicyError> {
        if prompt.len() as u64 >= self.context_limit {
            return Err(PolicyError::ContextLength { tokens: prompt.len() as u64, limit: self.context_limit });
        }
        let opts = GenerateOptions {
            max_tokens: sampling.max_tokens as usize,
            temperature: sampling.temperature.max(0.0) as f64,
            top_p: sampling.top_p as f64,
            seed: sampling.seed.unwrap_or(0),
        };
        let stops = sampling.stop.clone();
        let should_stop: Option<StopFn> = (!stops.is_empty()).then(|| {
            let (tok, stops) = (self.tokenizer.clone(), stops.clone());
            Box::new(move |ids: &[u32]| tok.decode(ids).map(|t| stops.iter().any(|s| t.contains(s.as_str()))).unwrap_or(false)) as StopFn
        });
        let constraint = sampling.constrain.map(|c| match c {
            Constrain::HarnessPatch => Box::new(PatchConstraint::new(self.pieces())) as Box<dyn Constraint>,
        });
        let request = Request { prompt, opts, stop_ids: self.tokenizer.stop_ids(), should_stop, top_logprobs, constraint };
        let gen = self
            .engine
            .submit(request)
            .await
            .map_err(|_| PolicyError::Native("the generation engine stopped".into()))?
            .map_err(native_err)?;
        let mut text = self.tokenizer.decode(&gen.tokens).map_err(native_err)?;
        if let Some(cut) = stops.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(cut);
        }
        Ok((gen, text))
    }
}

impl NativePolicy {
    /// Each token's text decoded alone (a byte of a longer character decodes to U+FFFD).
    fn pieces(&self) -> Arc<Pieces> {
        self.pieces
            .get_or_init(|| {
                let n = self.tokenizer.vocab_size() as u32;
                Arc::new(Pieces::new((0..n).map(|id| self.tokenizer.decode(&[id]).unwrap_or_default()).collect()))
            })
            .clone()
    }
}

/// The vocabulary's texts, for constraints that read them.
struct Pieces {
    /// Each token's text alone.
    texts: Vec<String>,
    /// Token ids by the first character of their text (empty texts left out): a character
    /// a grammar refuses rules out its whole group with one check.
    by_first: Vec<(char, Vec<u32>)>,
}

impl Pieces {
    fn new(texts: Vec<String>) -> Self {
        let mut groups: std::collections::BTreeMap<char, Vec<u32>> = Default::default();
        for (id, text) in texts.iter().enumerate() {
            if let Some(c) = text.chars().next() {
                groups.entry(c).or_default().push(id as u32);
            }
        }
        Pieces { texts, by_first: groups.into_iter().collect() }
    }
}

/// Decoding held to [`PatchGrammar`]: a token may come next when its text keeps the reply
/// in the grammar; the reply may end once a template is complete.
struct PatchConstraint {
    grammar: PatchGrammar,
    pieces: Arc<Pieces>,
    state: GrammarState,
}

impl PatchConstraint {
    fn new(pieces: Arc<Pieces>) -> Self {
        let grammar = PatchGrammar::new();
        let state = grammar.start();
        PatchConstraint { grammar, pieces, state }
    }
}

impl Constraint for PatchConstraint {
    fn allows(&self, id: u32) -> bool {
        match self.pieces.texts.get(id as usize) {
            Some(text) if !text.is_empty() => self.grammar.accepts(&self.state, text),
            _ => false,
        }
    }
    fn may_stop(&self) -> bool {
        self.grammar.is_complete(&self.state)
    }
    fn advance(&mut self, id: u32) {
        if let Some(text) = self.pieces.texts.get(id as usize) {
            self.state = self.grammar.advance(&self.state, text);
        }
    }
    fn mask(&self, allowed: &mut [bool]) {
        allowed.fill(false);
        let mut buf = [0u8; 4];
        for (c, ids) in &self.pieces.by_first {
            if !self.grammar.accepts(&self.state, c.encode_utf8(&mut buf)) {
                continue;
            }
            for &id in ids {
                if let Some(a) = allowed.get_mut(id as usize) {
                    *a = self.grammar.accepts(&self.state, &self.pieces.texts[id as usize]);
                }
            }
        }
    }
}

fn native_err(e: NativeError) -> PolicyError {
    match e {
        NativeError::Config { field, detail } if field == "prompt" && detail.contains("context") => PolicyError::InvalidOutput { detail },
        other => PolicyError::Native(other.to_string()),
    }
}

#[async_trait]
impl Policy for NativePolicy {
    fn checkpoint(&self) -> String {
        self.checkpoint.clone()
    }

    async fn chat(&self, messages: &[Message], tools: &[ToolSpec], sampling: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
        let offered: Vec<String> = tools.iter().map(|t| t.name.clone()).collect();
        let tok = self.tokenizer.clone();
        let (messages, tools_shown) = (messages.to_vec(), tools.to_vec());
        let prompt = tokio::task::spawn_blocking(move || prompt_ids(&tok, &messages, &tools_shown))
            .await
            .map_err(|e| PolicyError::Native(format!("tokenizer thread failed: {e}")))?
            .map_err(native_err)?;
        let (gen, text) = self.generate(prompt.clone(), sampling, 0).await?;
        // No structured tool channel: calls are read from the text protocol that
        // `with_tools` described in the system message.
        let names: Vec<&str> = offered.iter().map(String::as_str).collect();
        let tool_calls = jobs::policy::text_protocol::parse(&text, &names, true);
        Ok(PolicyOutput {
            text,
            tool_calls,
            prompt_tokens: prompt.len() as u32,
            completion_tokens: gen.tokens.len() as u32,
            prompt_hash: Some(schemas::prompt_hash(&prompt)),
            token_ids: gen.tokens,
            logprobs: gen.logprobs,
            finish_reason: match gen.finish {
                Finish::Stop => FinishReason::Stop,
                Finish::Length => FinishReason::Length,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grouped mask answers as the token-by-token check does, in every state a reply
    /// passes through.
    #[test]
    fn the_patch_mask_equals_the_per_token_check() {
        let mut texts: Vec<String> = [
            "", "{\"", "{", "\"", "hooks", "prompt", "_rules", "\": [", "{\"slot", "\": \"", "answer", "_format", "\", \"", "text",
            "Commit", " the", " value", ".\"", "}]", "}", "é", "\\", "\n", "-", "x1", "\"}]}", " ", "ids", "Say",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        texts.extend((b'a'..=b'z').map(|b| (b as char).to_string()));
        let pieces = Arc::new(Pieces::new(texts.clone()));
        let mut c = PatchConstraint::new(pieces);
        let reply = r#"{"prompt_rules": [{"slot": "answer_format", "text": "Commit the value."}]}"#;
        let mut seen_allowed = 0;
        for ch in reply.chars() {
            let mut mask = vec![true; texts.len()];
            c.mask(&mut mask);
            let one_by_one: Vec<bool> = (0..texts.len() as u32).map(|id| c.allows(id)).collect();
            assert_eq!(mask, one_by_one, "state {:?}", c.state);
            seen_allowed += mask.iter().filter(|a| **a).count();
            c.state = c.grammar.advance(&c.state, ch.encode_utf8(&mut [0; 4]));
        }
        assert!(c.may_stop() && seen_allowed > reply.len(), "the reply completes the grammar");
    }
}
