//! The stages of a run (Algorithm 1) as a type. `state.json` stores them by their labels
//! (`update:3:base`, `calibration:final:3`, ...); [`Stage`]'s `Display` writes those labels
//! and its `FromStr` reads them back, so the scheduler matches on variants, never on
//! split strings, and a label that names no stage is an error that says which it was.

use std::fmt;
use std::str::FromStr;

/// The part of an update a stage runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum UpdatePart {
    /// K rollouts of each task under H0.
    Base,
    /// Rescue rollouts of the all-fail groups.
    Rescue,
    /// Groups formed from base and rescue rows.
    Groups,
    /// The learner's update.
    Learn,
    /// An editor run (Harness-R1): the editor's patches for this step's packets, rerun.
    Edit,
}

impl UpdatePart {
    /// Every part, in run order.
    pub const ALL: [UpdatePart; 5] = [UpdatePart::Base, UpdatePart::Rescue, UpdatePart::Groups, UpdatePart::Learn, UpdatePart::Edit];

    pub fn as_str(self) -> &'static str {
        match self {
            UpdatePart::Base => "base",
            UpdatePart::Rescue => "rescue",
            UpdatePart::Groups => "groups",
            UpdatePart::Learn => "learn",
            UpdatePart::Edit => "edit",
        }
    }
}

/// One stage of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Directional Harness Evolution (§3.2).
    Evolve,
    /// An editor run (Harness-R1): the frozen target under the parent harness, cut into
    /// trace packets.
    Packets,
    /// The starting policy evaluated on the test tasks.
    Baseline,
    /// Re-anchoring after update `n` (0: before training).
    Calibration(u32),
    /// Re-anchoring after the last update, `n`.
    FinalCalibration(u32),
    /// One part of update `u` (1-based).
    Update(u32, UpdatePart),
    /// The trained policy evaluated on the test tasks.
    Evaluation,
    /// `report.md` and its plots.
    Report,
}

impl Stage {
    /// The stage's kind, as cost rows name it (`base`, `learn`, `calibration`, ...).
    pub fn kind(self) -> &'static str {
        match self {
            Stage::Evolve => "evolve",
            Stage::Packets => "packets",
            Stage::Baseline => "baseline",
            Stage::Calibration(_) | Stage::FinalCalibration(_) => "calibration",
            Stage::Update(_, part) => part.as_str(),
            Stage::Evaluation => "evaluation",
            Stage::Report => "report",
        }
    }

    /// The step a stage's costs are recorded at: its update, the run's last update
    /// (`updates`) for the final evaluation and report, 0 for evolution and the baseline.
    pub fn step(self, updates: u32) -> u32 {
        match self {
            Stage::Update(u, _) | Stage::Calibration(u) | Stage::FinalCalibration(u) => u,
            Stage::Evaluation | Stage::Report => updates,
            Stage::Evolve | Stage::Packets | Stage::Baseline => 0,
        }
    }

    /// Whether the stage samples the policy (and so first brings an endpoint to the
    /// weights it samples).
    pub fn samples_policy(self) -> bool {
        !matches!(self, Stage::Update(_, UpdatePart::Groups | UpdatePart::Learn) | Stage::Report)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stage::Evolve => f.write_str("evolve"),
            Stage::Packets => f.write_str("packets"),
            Stage::Baseline => f.write_str("baseline"),
            Stage::Calibration(n) => write!(f, "calibration:{n}"),
            Stage::FinalCalibration(n) => write!(f, "calibration:final:{n}"),
            Stage::Update(u, part) => write!(f, "update:{u}:{}", part.as_str()),
            Stage::Evaluation => f.write_str("evaluation"),
            Stage::Report => f.write_str("report"),
        }
    }
}

/// A label that names no stage.
#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not a stage label (evolve, packets, baseline, calibration:N, calibration:final:N, update:N:base|rescue|groups|learn|edit, evaluation, report)")]
pub struct UnknownStage(pub String);

impl FromStr for Stage {
    type Err = UnknownStage;

    fn from_str(label: &str) -> Result<Self, Self::Err> {
        let bad = || UnknownStage(label.to_string());
        let num = |s: &str| s.parse::<u32>().map_err(|_| bad());
        let parts: Vec<&str> = label.split(':').collect();
        Ok(match parts.as_slice() {
            ["evolve"] => Stage::Evolve,
            ["packets"] => Stage::Packets,
            ["baseline"] => Stage::Baseline,
            ["calibration", "final", n] => Stage::FinalCalibration(num(n)?),
            ["calibration", n] => Stage::Calibration(num(n)?),
            ["update", u, part] => {
                let part = UpdatePart::ALL.into_iter().find(|p| p.as_str() == *part).ok_or_else(bad)?;
                Stage::Update(num(u)?, part)
            }
            ["evaluation"] => Stage::Evaluation,
            ["report"] => Stage::Report,
            _ => return Err(bad()),
        })
    }
}

/// The stages of an editor run.
pub fn editor_stages(e: &handlers::spec::EditorTrainingSection) -> Vec<Stage> {
    let mut s = vec![Stage::Packets];
    for u in 1..=e.steps {
        s.push(Stage::Update(u, UpdatePart::Edit));
        s.push(Stage::Update(u, UpdatePart::Learn));
    }
    s.push(Stage::Report);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip_and_unknown_ones_are_named() {
        let all = [
            Stage::Evolve,
            Stage::Packets,
            Stage::Baseline,
            Stage::Calibration(0),
            Stage::Calibration(2),
            Stage::FinalCalibration(3),
            Stage::Update(12, UpdatePart::Base),
            Stage::Update(1, UpdatePart::Rescue),
            Stage::Update(1, UpdatePart::Groups),
            Stage::Update(3, UpdatePart::Learn),
            Stage::Update(2, UpdatePart::Edit),
            Stage::Evaluation,
            Stage::Report,
        ];
        for s in all {
            assert_eq!(s.to_string().parse::<Stage>().unwrap(), s, "{s}");
        }
        assert_eq!(Stage::Update(3, UpdatePart::Base).to_string(), "update:3:base");
        assert_eq!(Stage::FinalCalibration(4).to_string(), "calibration:final:4");
        for bad in ["", "update:x:base", "update:1:bake", "calibration:final", "finished", "calibration:-1"] {
            let e = bad.parse::<Stage>().unwrap_err().to_string();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn kinds_and_steps_of_cost_rows() {
        assert_eq!(Stage::Update(3, UpdatePart::Base).kind(), "base");
        assert_eq!(Stage::Update(12, UpdatePart::Learn).kind(), "learn");
        assert_eq!(Stage::FinalCalibration(3).kind(), "calibration");
        assert_eq!(Stage::Calibration(0).kind(), "calibration");
        assert_eq!(Stage::Update(3, UpdatePart::Rescue).step(9), 3);
        assert_eq!(Stage::FinalCalibration(4).step(9), 4);
        assert_eq!(Stage::Calibration(2).step(9), 2);
        assert_eq!(Stage::Evaluation.step(9), 9);
        assert_eq!(Stage::Evolve.step(9), 0);
        for s in [Stage::Evolve, Stage::Packets, Stage::Baseline, Stage::Calibration(0), Stage::Evaluation, Stage::Report] {
            assert!(crate::cost::KINDS.contains(&s.kind()), "{s}");
        }
        for part in UpdatePart::ALL {
            assert!(crate::cost::KINDS.contains(&Stage::Update(1, part).kind()), "{part:?}");
        }
    }

    #[test]
    fn an_editor_run_alternates_edit_and_learn_after_the_packets() {
        let e: handlers::spec::EditorTrainingSection = toml::from_str("steps = 2").unwrap();
        let labels: Vec<String> = editor_stages(&e).iter().map(|s| s.to_string()).collect();
        assert_eq!(labels, ["packets", "update:1:edit", "update:1:learn", "update:2:edit", "update:2:learn", "report"]);
        assert_eq!((e.patches, e.packets_per_step, e.parent.as_str()), (8, 2, "h0"));
    }
}
