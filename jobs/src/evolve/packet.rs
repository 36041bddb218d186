//! Trace packets (Harness-R1 §3.1): a deterministic extractor keeps only a parent's failed
//! episodes and compacts each into its task, the turns that matter, how it ended and the
//! rule diagnosis, so that an editor reads a bounded text and the same rows always give
//! the same packet. Each packet also names control tasks the parent solved: the patched
//! harness is rerun on both, so a patch that breaks what worked pays for it (Eq. 1 is over
//! the whole batch).
//!
//! Sanitised: only what the target saw and did is quoted (the task text, its replies and
//! the tool results); control characters are dropped and every quote is clipped, so no
//! grader detail or expected answer reaches the editor.

use serde::{Deserialize, Serialize};

use super::diagnose::{diagnose_trajectory, is_valid_failure};
use schemas::{job_id, JobIdParts, Role, TracePacket, Trajectory, TurnSource};

/// How packets are cut and how much of each episode they quote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PacketSettings {
    /// Failed tasks per packet.
    pub failed: usize,
    /// Control tasks (solved by the parent) per packet, when there are that many.
    pub controls: usize,
    /// Characters quoted of the task text.
    pub task_chars: usize,
    /// Characters quoted of each reply or tool result.
    pub turn_chars: usize,
    /// Replies and tool results quoted per episode (the last ones: where it went wrong).
    pub turns: usize,
    /// Cap on a packet's whole text.
    pub max_chars: usize,
}

impl Default for PacketSettings {
    fn default() -> Self {
        PacketSettings { failed: 4, controls: 2, task_chars: 400, turn_chars: 240, turns: 4, max_chars: 4000 }
    }
}

/// The packets of a parent's episodes `rows` (one attempt per task, all under the same
/// harness and seed): failed tasks in task order, `settings.failed` per packet, each with
/// the next `settings.controls` solved tasks (round robin). Rows ended by infrastructure or
/// policy-server errors are neither failures nor controls. No failed task: no packet.
pub fn packets(run_id: &str, rows: &[Trajectory], settings: &PacketSettings) -> Vec<TracePacket> {
    let mut rows: Vec<&Trajectory> = rows.iter().collect();
    rows.sort_by(|a, b| (&a.task_id, a.attempt).cmp(&(&b.task_id, b.attempt)));
    let failed: Vec<&Trajectory> = rows.iter().copied().filter(|r| is_valid_failure(r)).collect();
    let solved: Vec<&Trajectory> = rows.iter().copied().filter(|r| r.success).collect();
    let mut out = vec![];
    let mut next_control = 0;
    for chunk in failed.chunks(settings.failed.max(1)) {
        let take = settings.controls.min(solved.len());
        let controls: Vec<&Trajectory> = (0..take).map(|i| solved[(next_control + i) % solved.len()]).collect();
        next_control += take;
        out.push(packet(run_id, chunk, &controls, settings));
    }
    out
}

fn packet(run_id: &str, failed: &[&Trajectory], controls: &[&Trajectory], settings: &PacketSettings) -> TracePacket {
    let first = failed[0];
    let all: Vec<&Trajectory> = failed.iter().chain(controls).copied().collect();
    let task_ids: Vec<String> = all.iter().map(|r| r.task_id.clone()).collect();
    let mut text = format!(
        "{} of {} episodes under harness `{}` failed; {} similar episodes succeeded (controls, not shown).\n",
        failed.len(),
        all.len(),
        first.harness_id,
        controls.len()
    );
    for (i, row) in failed.iter().enumerate() {
        text.push_str(&episode(i + 1, row, settings));
    }
    let text = clip(&text, settings.max_chars);
    let packet_id = job_id(&JobIdParts {
        run_id: "packet",
        stage: &first.harness_version,
        task_id: &task_ids.join("\u{1f}"),
        seed: first.seed,
        ..Default::default()
    });
    TracePacket {
        packet_id,
        run_id: run_id.to_string(),
        parent_harness_id: first.harness_id.clone(),
        parent_harness_version: first.harness_version.clone(),
        controls: all.iter().map(|r| r.success).collect(),
        parent_rewards: all.iter().map(|r| r.reward).collect(),
        source_trajectory_ids: all.iter().map(|r| r.trajectory_id.clone()).collect(),
        task_ids,
        seed: first.seed,
        text,
    }
}

/// One failed episode: its task, its last `settings.turns` replies and results, how it
/// ended and what the rule diagnoser reads in it.
fn episode(n: usize, row: &Trajectory, settings: &PacketSettings) -> String {
    let task = row.turns.iter().find(|t| t.role == Role::User && t.source == TurnSource::Env).map(|t| t.text.as_str()).unwrap_or("");
    let mut s = format!("\n## Failure {n}: task {} ({})\nTask: {}\n", row.task_id, row.task_type, clip(task, settings.task_chars));
    let acted: Vec<String> = row
        .turns
        .iter()
        .skip_while(|t| !(t.role == Role::User && t.source == TurnSource::Env))
        .skip(1)
        .map(|t| {
            let who = match (t.source, t.role) {
                (TurnSource::Policy, _) => "agent",
                (TurnSource::Env, _) => "result",
                (TurnSource::Harness, _) => "harness",
                (TurnSource::System, _) => "system",
            };
            format!("- {who}: {}\n", clip(&t.text, settings.turn_chars))
        })
        .collect();
    if acted.len() > settings.turns {
        s.push_str(&format!("- ({} earlier turns)\n", acted.len() - settings.turns));
    }
    for line in acted.iter().skip(acted.len().saturating_sub(settings.turns)) {
        s.push_str(line);
    }
    s.push_str(&format!("Ended: {}", row.termination.as_str()));
    if let Some(e) = &row.error_message {
        s.push_str(&format!(" ({})", clip(e, settings.turn_chars)));
    }
    s.push('\n');
    let findings = diagnose_trajectory(row);
    if !findings.is_empty() {
        let causes: Vec<String> = findings.iter().map(|f| format!("{} ({})", f.cause, clip(&f.evidence, 120))).collect();
        s.push_str(&format!("Diagnosis: {}\n", causes.join("; ")));
    }
    s
}

/// `text` without control characters (newlines kept), cut to at most `max` characters
/// with an ellipsis.
fn clip(text: &str, max: usize) -> String {
    let clean: String = text.chars().filter(|c| *c == '\n' || !c.is_control()).collect();
    if clean.chars().count() <= max {
        return clean;
    }
    let mut cut: String = clean.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use schemas::{RolloutKind, Split, Termination, Turn};

    fn turn(role: Role, source: TurnSource, text: &str) -> Turn {
        Turn::context(0, role, source, text.into())
    }

    pub(crate) fn row(task: &str, success: bool, replies: usize) -> Trajectory {
        let mut turns = vec![
            turn(Role::System, TurnSource::System, "You are an agent."),
            turn(Role::User, TurnSource::Env, &format!("Question of {task}: how many rows?\u{7}")),
        ];
        for i in 0..replies {
            turns.push(turn(Role::Assistant, TurnSource::Policy, &format!("I think the answer is {i}.")));
            turns.push(turn(Role::User, TurnSource::Harness, "Your reply called no tool."));
        }
        Trajectory {
            trajectory_id: format!("t-{task}"),
            run_id: "r".into(),
            job_id: "j".into(),
            step: 0,
            kind: RolloutKind::Eval,
            split: Split::Train,
            task_id: task.into(),
            task_type: "counting".into(),
            group_id: "g".into(),
            attempt: 0,
            harness_id: "h0".into(),
            harness_version: "v0".into(),
            policy_checkpoint: "base".into(),
            seed: 42,
            reward: f64::from(u8::from(success)),
            success,
            termination: if success { Termination::Committed } else { Termination::RoundLimit },
            error_class: None,
            error_message: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            harness_tokens: 0,
            model_calls: 0,
            env_actions: 0,
            started_at_ms: 0,
            duration_ms: 0,
            policy_ms: 0,
            env_ms: 0,
            temperature: 0.0,
            tool_view: String::new(),
            turns,
        }
    }

    #[test]
    fn packets_hold_failed_tasks_with_controls_and_the_parents_outcomes() {
        let rows: Vec<Trajectory> = ["a", "b", "c", "d", "e", "f", "g"].iter().enumerate().map(|(i, t)| row(t, i % 3 == 0, 3)).collect();
        // a, d, g solved; b, c, e, f failed.
        let s = PacketSettings { failed: 3, controls: 2, ..PacketSettings::default() };
        let ps = packets("r", &rows, &s);
        assert_eq!(ps.len(), 2);
        assert_eq!(ps[0].task_ids, ["b", "c", "e", "a", "d"]);
        assert_eq!(ps[0].controls, [false, false, false, true, true]);
        assert_eq!(ps[0].parent_rewards, [0.0, 0.0, 0.0, 1.0, 1.0]);
        assert_eq!(ps[1].task_ids, ["f", "g", "a"], "controls continue round robin");
        assert_eq!(ps[0].seed, 42);
        assert_eq!(ps[0].source_trajectory_ids[0], "t-b");
        assert!(ps[0].text.contains("task b (counting)") && ps[0].text.contains("Ended: round_limit"));
        assert!(!ps[0].text.contains("task a"), "controls are not quoted");
        assert!(!ps[0].text.contains('\u{7}'), "control characters are dropped");
        // Deterministic: the same rows in another order give the same packets.
        let mut shuffled = rows.clone();
        shuffled.reverse();
        assert_eq!(packets("r", &shuffled, &s), ps);
        assert_ne!(ps[0].packet_id, ps[1].packet_id);
    }

    #[test]
    fn packets_are_bounded_and_quote_the_last_turns() {
        let rows = vec![row("a", false, 40)];
        let s = PacketSettings { turns: 2, max_chars: 700, ..PacketSettings::default() };
        let p = &packets("r", &rows, &s)[0];
        assert!(p.text.chars().count() <= 700);
        assert!(p.text.contains("(78 earlier turns)"), "{}", p.text);
        assert!(p.text.contains("the answer is 39"));
        assert!(!p.text.contains("the answer is 38."));
        assert!(packets("r", &[row("a", true, 1)], &s).is_empty(), "no failure, no packet");
    }
}
