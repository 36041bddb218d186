//! The learned editor (Harness-R1 as an evolution editor, `[evolution] editor = "learned"`):
//! a harness editor trained by an editor run ([`crate::edit`]) writes the children of
//! evolution. It reads what it was trained on: the parent and a trace packet
//! ([`super::packet`]) cut from the parent's failed episodes of the direction, with controls
//! the parent solved, in the edit job's prompt ([`crate::edit::prompt`]). Its reply is one
//! patch, applied and validated like every editor's child.
//!
//! The first version is decoded with the editor's sampling (greedy by default, Appendix F:
//! "the editor answers deterministically"). A revision cannot show the editor its feedback
//! (it was never trained on feedback), so it samples again at the training temperature with
//! a seed of its variant: a different patch for the same packet.

use async_trait::async_trait;

use super::editor::{patch_from_reply, EditError, EditRequest, Editor};
use super::packet::{packets, PacketSettings};
use crate::policy::{Policy, SamplingParams};
use schemas::Trajectory;

/// The temperature of a revision's sample when the first version was greedy: an editor
/// run's default (`[editor_training] temperature`).
pub const REVISION_TEMPERATURE: f32 = 1.0;

/// An editor policy trained on trace packets.
pub struct LearnedEditor<'p> {
    pub policy: &'p dyn Policy,
    /// What the pool records as the children's editor: `learned:<editor run>@<step>`.
    pub name: String,
    /// The first version's sampling (with its seed); a revision varies seed and temperature.
    pub sampling: SamplingParams,
    /// How the packet is cut (an editor run's defaults unless it was trained otherwise).
    pub packet: PacketSettings,
}

impl LearnedEditor<'_> {
    /// The name a pool entry records for a child of the editor run `run`'s checkpoint `step`.
    pub fn name_of(run: &str, step: u32) -> String {
        format!("learned:{run}@{step}")
    }

    /// The sampling of a request: the editor's own for a first version, a resample (the
    /// training temperature when greedy, a seed of the variant) for a revision.
    fn sampling_for(&self, req: &EditRequest<'_>) -> SamplingParams {
        if req.feedback.is_none() {
            return self.sampling.clone();
        }
        let temperature = if self.sampling.temperature > 0.0 { self.sampling.temperature } else { REVISION_TEMPERATURE };
        let seed = self.sampling.seed.unwrap_or(0).wrapping_add(1 + req.variant as u64);
        SamplingParams { temperature, seed: Some(seed), ..self.sampling.clone() }
    }
}

/// The packet a learned editor reads for a request: the parent's failed episodes on the
/// direction's tasks (at most `settings.failed`), with controls the parent solved. `None`
/// when no episode of the direction is a valid failure of the parent.
pub fn request_packet(req: &EditRequest<'_>, settings: &PacketSettings) -> Option<schemas::TracePacket> {
    let tasks = req.direction.tasks();
    let rows: Vec<Trajectory> =
        req.evidence.iter().filter(|r| r.harness_id == req.parent.id && (r.success || tasks.contains(&r.task_id))).cloned().collect();
    let run_id = rows.first().map(|r| r.run_id.clone()).unwrap_or_default();
    packets(&run_id, &rows, settings).into_iter().next()
}

#[async_trait]
impl Editor for LearnedEditor<'_> {
    fn name(&self) -> &str {
        &self.name
    }
    async fn edit(&self, req: &EditRequest<'_>) -> Result<schemas::HarnessSpec, EditError> {
        let Some(packet) = request_packet(req, &self.packet) else {
            return Err(EditError::NoRepair {
                child: req.child_id.clone(),
                causes: format!("{} (no failed episode of the parent on its tasks to show the learned editor)", req.direction.summary),
            });
        };
        let messages = crate::edit::prompt(req.parent, &packet);
        let reply = self.policy.chat(&messages, &[], &self.sampling_for(req)).await.map_err(|e| EditError::Backend(e.to_string()))?;
        patch_from_reply(req.parent, &reply.text, &req.child_id, req.generation, &req.direction.summary, req.validate)
            .map_err(|reason| EditError::Rejected { child: req.child_id.clone(), reason })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Mutex;

    use super::*;
    use crate::env::ToolSpec;
    use crate::evolve::direction::Direction;
    use crate::harness::ValidateOptions;
    use crate::policy::{Constrain, Message, PolicyError, PolicyOutput};
    use schemas::HarnessSpec;

    /// Answers one fixed patch and records what it was asked.
    struct Recording {
        reply: String,
        seen: Mutex<Vec<(Vec<Message>, SamplingParams)>>,
    }

    #[async_trait]
    impl Policy for Recording {
        fn checkpoint(&self) -> String {
            "editor".into()
        }
        async fn chat(&self, messages: &[Message], _: &[ToolSpec], s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
            self.seen.lock().unwrap().push((messages.to_vec(), s.clone()));
            let mut out = crate::testing::say(&self.reply, None).unwrap();
            out.text = self.reply.clone();
            Ok(out)
        }
    }

    fn rows() -> Vec<Trajectory> {
        let mut rows = vec![];
        for (task, success) in [("a", false), ("b", false), ("c", true), ("d", false)] {
            let mut r = crate::evolve::packet::tests::row(task, success, 2);
            r.run_id = "evo".into();
            r.harness_id = schemas::H0_ID.into();
            rows.push(r);
        }
        rows
    }

    #[tokio::test]
    async fn the_learned_editor_reads_a_packet_of_the_directions_failures_and_its_patch_is_the_child() {
        let policy = Recording {
            reply: r#"{"prompt_rules": [{"slot": "answer_format", "text": "Commit the answer with commit_final_answer."}]}"#.into(),
            seen: Mutex::new(vec![]),
        };
        let sampling = SamplingParams { temperature: 0.0, seed: Some(42), constrain: Some(Constrain::HarnessPatch), ..Default::default() };
        let editor = LearnedEditor {
            policy: &policy,
            name: LearnedEditor::name_of("editor-run", 2),
            sampling: sampling.clone(),
            packet: PacketSettings::default(),
        };
        let parent = HarnessSpec::h0();
        // The direction is supported by a and b; d failed for another direction.
        let direction = Direction {
            causes: ["no_commit".to_string()].into(),
            support: BTreeMap::from([("no_commit".to_string(), BTreeSet::from(["a".to_string(), "b".to_string()]))]),
            summary: "no_commit".into(),
        };
        let validate =
            ValidateOptions { tools: Some(vec!["execute_sql".into(), "commit_final_answer".into()]), harness_actions: true, base: false };
        let evidence = rows();
        let mut req = EditRequest {
            parent: &parent,
            direction: &direction,
            child_id: "g1-s1".into(),
            generation: 1,
            variant: 0,
            feedback: None,
            other_briefs: vec![],
            earlier: vec![],
            validate: &validate,
            evidence: &evidence,
        };
        let child = editor.edit(&req).await.unwrap();
        assert_eq!((child.id.as_str(), child.parent.as_deref(), child.generation), ("g1-s1", Some("h0"), 1));
        assert_eq!(child.prompt_rules.len(), 1);
        assert_eq!(editor.name(), "learned:editor-run@2");

        let seen = policy.seen.lock().unwrap().clone();
        let (messages, s) = &seen[0];
        assert_eq!(s, &sampling, "the first version uses the editor's own sampling, constrained");
        let packet = &messages[1].content;
        assert!(packet.contains("Failure packet:") && packet.contains("task a (") && packet.contains("task b ("), "{packet}");
        assert!(!packet.contains("task d ("), "a failure outside the direction is not shown: {packet}");
        assert_eq!(
            messages[0].content,
            crate::edit::prompt(&parent, &request_packet(&req, &PacketSettings::default()).unwrap())[0].content
        );

        // A revision samples again, at the training temperature with its variant's seed.
        req.variant = 1;
        req.feedback = Some("repaired 0 of 2 targeted tasks".into());
        editor.edit(&req).await.unwrap();
        let s = policy.seen.lock().unwrap()[1].1.clone();
        assert_eq!((s.temperature, s.seed, s.constrain), (REVISION_TEMPERATURE, Some(44), Some(Constrain::HarnessPatch)));

        // No failure of the direction among the parent's episodes: no repair, no call.
        let solved: Vec<Trajectory> = evidence.iter().filter(|r| r.success).cloned().collect();
        req.evidence = &solved;
        assert!(matches!(editor.edit(&req).await, Err(EditError::NoRepair { .. })));
        assert_eq!(policy.seen.lock().unwrap().len(), 2);

        // An invalid reply is rejected with its reason.
        let bad = Recording { reply: "{\"hooks\": [{\"id\": 3}]}".into(), seen: Mutex::new(vec![]) };
        let editor = LearnedEditor { policy: &bad, ..editor };
        req.evidence = &evidence;
        assert!(matches!(editor.edit(&req).await, Err(EditError::Rejected { .. })));
    }
}
