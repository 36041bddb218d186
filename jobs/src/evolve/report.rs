//! Report figures of a pool: repaired vs regressed validation tasks per sibling relative
//! to H0 (Harness-S Figure 1a) and the directed repair-overlap matrix |R_i ∩ R_j| / |R_i|
//! (Figure 5, Appendix E). The numbers are pure functions; [`plot_repairs`] and
//! [`plot_overlap`] draw them as PNG with `plotters`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use schemas::HarnessSpec;

/// Repairs and regressions of one sibling relative to H0 on shared validation tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairCount {
    pub sibling: String,
    /// R_i: tasks H0 fails and the sibling solves.
    pub repaired: BTreeSet<String>,
    /// Tasks H0 solves and the sibling fails.
    pub regressed: BTreeSet<String>,
}

/// Figure 1a: `h0` and each sibling's solved sets over the same `tasks`.
pub fn repair_counts(tasks: &BTreeSet<String>, h0: &BTreeSet<String>, siblings: &BTreeMap<String, BTreeSet<String>>) -> Vec<RepairCount> {
    siblings
        .iter()
        .map(|(id, solved)| RepairCount {
            sibling: id.clone(),
            repaired: tasks.iter().filter(|t| !h0.contains(*t) && solved.contains(*t)).cloned().collect(),
            regressed: tasks.iter().filter(|t| h0.contains(*t) && !solved.contains(*t)).cloned().collect(),
        })
        .collect()
}

/// Figure 1a's counts for a pool: every sibling against the pool's `h0` member on the
/// pool's validation tasks; `None` when the pool has no `h0` (nothing to compare with).
pub fn pool_repair_counts(m: &super::pool::PoolManifest) -> Option<Vec<RepairCount>> {
    let h0 = m.member(schemas::H0_ID)?;
    let tasks: BTreeSet<String> = m.validation_tasks.iter().cloned().collect();
    let base: BTreeSet<String> = h0.validation_coverage.iter().cloned().collect();
    let siblings: BTreeMap<String, BTreeSet<String>> = m
        .members
        .iter()
        .filter(|e| e.id != schemas::H0_ID)
        .map(|e| (e.id.clone(), e.validation_coverage.iter().cloned().collect()))
        .collect();
    Some(repair_counts(&tasks, &base, &siblings))
}

/// Each sibling's mechanisms and on which side they act: `policy-side` when every
/// component changes what the policy itself writes (worked examples, prompt rules, skills,
/// context, memory, tool views, warn / block_and_prompt hooks), else `harness-side` with
/// the hooks that act in its place (`force_action`, `rewrite_action`); with an evolution
/// manifest, also the editor that wrote each (`template`, `llm`, `learned:<run>@<step>`).
/// Markdown table.
pub fn mechanism_table(specs: &[HarnessSpec], manifest: Option<&super::pool::PoolManifest>) -> String {
    let mut md = match manifest {
        Some(_) => String::from("| sibling | editor | components | side |\n|---|---|---|---|\n"),
        None => String::from("| sibling | components | side |\n|---|---|---|\n"),
    };
    for s in specs.iter().filter(|s| s.id != schemas::H0_ID) {
        let mut parts: Vec<String> = Vec::new();
        for (name, n) in [
            ("examples", s.examples.len()),
            ("prompt rules", s.prompt_rules.len()),
            ("skills", s.skills.len()),
            ("context", s.context.len()),
            ("memory", s.memory.len()),
            ("hooks", s.hooks.len()),
        ] {
            if n > 0 {
                parts.push(format!("{n} {name}"));
            }
        }
        if s.tool_view.is_some() {
            parts.push("tool view".into());
        }
        let forced = crate::harness::harness_side_hooks(s);
        let side = if forced.is_empty() {
            "policy-side".to_string()
        } else {
            format!("harness-side (acts for the policy: {})", forced.join(", "))
        };
        let editor = match manifest {
            Some(m) => format!(" {} |", m.member(&s.id).map(|e| e.editor.as_str()).unwrap_or("-")),
            None => String::new(),
        };
        md.push_str(&format!("| {} |{editor} {} | {} |\n", s.id, if parts.is_empty() { "none".into() } else { parts.join(", ") }, side));
    }
    md
}

/// Figure 1a and 5 as a Markdown table: repaired and regressed tasks per sibling (with
/// the repaired ids), the union of repairs and the mean directed overlap.
pub fn repair_table(counts: &[RepairCount]) -> String {
    let mut md = String::from("| sibling | repaired | regressed | repaired tasks |\n|---|---:|---:|---|\n");
    for c in counts {
        let ids: Vec<&str> = c.repaired.iter().map(String::as_str).collect();
        md.push_str(&format!("| {} | {} | {} | {} |\n", c.sibling, c.repaired.len(), c.regressed.len(), ids.join(", ")));
    }
    let union: BTreeSet<&String> = counts.iter().flat_map(|c| c.repaired.iter()).collect();
    let distinct: BTreeSet<&BTreeSet<String>> = counts.iter().filter(|c| !c.repaired.is_empty()).map(|c| &c.repaired).collect();
    md.push_str(&format!(
        "\nUnion of repairs: {} task(s); {} distinct non-empty repaired set(s); mean directed repair overlap: {}.\n",
        union.len(),
        distinct.len(),
        match mean_overlap(&overlap_matrix(counts)) {
            Some(v) => format!("{:.1}%", v * 100.0),
            None => "n/a (fewer than two siblings with repairs)".into(),
        }
    ));
    md
}

/// Figure 5: cell (i, j) = |R_i ∩ R_j| / |R_i| (row-normalised, so directional); `None` on
/// the diagonal and for rows with no repairs.
pub fn overlap_matrix(counts: &[RepairCount]) -> Vec<Vec<Option<f64>>> {
    counts
        .iter()
        .enumerate()
        .map(|(i, ri)| {
            counts
                .iter()
                .enumerate()
                .map(|(j, rj)| {
                    if i == j || ri.repaired.is_empty() {
                        None
                    } else {
                        Some(ri.repaired.intersection(&rj.repaired).count() as f64 / ri.repaired.len() as f64)
                    }
                })
                .collect()
        })
        .collect()
}

/// Mean of the defined off-diagonal cells (Appendix E reports 62.47%).
pub fn mean_overlap(matrix: &[Vec<Option<f64>>]) -> Option<f64> {
    let cells: Vec<f64> = matrix.iter().flatten().flatten().copied().collect();
    if cells.is_empty() {
        None
    } else {
        Some(cells.iter().sum::<f64>() / cells.len() as f64)
    }
}

/// Why a figure could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("drawing {file}: {detail}")]
pub struct PlotError {
    pub file: String,
    pub detail: String,
}

fn plot_err(file: &Path, e: impl std::fmt::Display) -> PlotError {
    PlotError { file: file.display().to_string(), detail: e.to_string() }
}

/// Figure 1a as a PNG: per sibling, repaired tasks up (green), regressed down (red).
pub fn plot_repairs(counts: &[RepairCount], file: &Path) -> Result<(), PlotError> {
    let root = BitMapBackend::new(file, (120 + 70 * counts.len().max(1) as u32, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(file, e))?;
    let top = counts.iter().map(|c| c.repaired.len()).max().unwrap_or(0).max(1) as i32;
    let bottom = counts.iter().map(|c| c.regressed.len()).max().unwrap_or(0) as i32;
    let n = counts.len().max(1) as i32;
    let mut chart = ChartBuilder::on(&root)
        .caption("Repaired vs regressed tasks relative to H0", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(40)
        .build_cartesian_2d((0..n - 1).into_segmented(), -(bottom + 1)..(top + 1))
        .map_err(|e| plot_err(file, e))?;
    let names: Vec<String> = counts.iter().map(|c| c.sibling.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(counts.len().max(1))
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc("tasks")
        .draw()
        .map_err(|e| plot_err(file, e))?;
    // One bar per sibling, with a gap: repaired up (green), regressed down (red).
    let bar = |i: usize, lo: i32, hi: i32, color: RGBAColor| {
        let mut r = Rectangle::new([(SegmentValue::Exact(i as i32), lo), (SegmentValue::Exact(i as i32 + 1), hi)], color.filled());
        r.set_margin(0, 0, 12, 12);
        r
    };
    chart
        .draw_series(counts.iter().enumerate().map(|(i, c)| bar(i, 0, c.repaired.len() as i32, GREEN.mix(0.7))))
        .map_err(|e| plot_err(file, e))?;
    chart
        .draw_series(counts.iter().enumerate().map(|(i, c)| bar(i, -(c.regressed.len() as i32), 0, RED.mix(0.7))))
        .map_err(|e| plot_err(file, e))?;
    root.present().map_err(|e| plot_err(file, e))
}

/// Figure 5 as a PNG heat map with the percentage in each cell.
pub fn plot_overlap(counts: &[RepairCount], file: &Path) -> Result<(), PlotError> {
    let m = overlap_matrix(counts);
    let n = counts.len().max(1);
    let cell = 70u32;
    let root = BitMapBackend::new(file, (140 + cell * n as u32, 120 + cell * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(file, e))?;
    let names: Vec<String> = counts.iter().map(|c| c.sibling.clone()).collect();
    let last = n as i32 - 1;
    let mut chart = ChartBuilder::on(&root)
        .caption("Shared repair coverage |Ri ∩ Rj| / |Ri|", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(80)
        // Segmented coordinates over 0..n-1 give n cells (the last value is a segment too).
        .build_cartesian_2d((0..last).into_segmented(), (0..last).into_segmented())
        .map_err(|e| plot_err(file, e))?;
    // Row i (sibling i) is drawn top-down: y = n - 1 - i.
    let label = |v: &SegmentValue<i32>, flip: bool| match v {
        SegmentValue::CenterOf(k) => {
            let k = *k as usize;
            let idx = if flip { (n - 1).checked_sub(k) } else { Some(k) };
            idx.and_then(|i| names.get(i)).cloned().unwrap_or_default()
        }
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_labels(n)
        .y_labels(n)
        .x_label_formatter(&|v| label(v, false))
        .y_label_formatter(&|v| label(v, true))
        .x_desc("other sibling")
        .y_desc("sibling")
        .draw()
        .map_err(|e| plot_err(file, e))?;
    let centered = ("sans-serif", 14).into_font().into_text_style(&root).pos(Pos::new(HPos::Center, VPos::Center));
    for (i, row) in m.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            let (x, y) = (j as i32, (n - 1 - i) as i32);
            let color = match v {
                Some(v) => RGBColor(255 - (v * 200.0) as u8, 255 - (v * 120.0) as u8, 255),
                None => RGBColor(230, 230, 230),
            };
            let cell = Rectangle::new(
                [(SegmentValue::Exact(x), SegmentValue::Exact(y)), (SegmentValue::Exact(x + 1), SegmentValue::Exact(y + 1))],
                color.filled(),
            );
            chart.draw_series(std::iter::once(cell)).map_err(|e| plot_err(file, e))?;
            if let Some(v) = v {
                let text =
                    Text::new(format!("{:.0}%", v * 100.0), (SegmentValue::CenterOf(x), SegmentValue::CenterOf(y)), centered.clone());
                chart.draw_series(std::iter::once(text)).map_err(|e| plot_err(file, e))?;
            }
        }
    }
    root.present().map_err(|e| plot_err(file, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mechanism_table_marks_policy_side_and_harness_side_siblings() {
        let spec = |v: serde_json::Value| -> HarnessSpec { serde_json::from_value(v).unwrap() };
        let example = spec(
            serde_json::json!({"id": "s1", "parent": "h0", "examples": [{"name": "e", "turns": [{"role": "user", "text": "q"}, {"role": "assistant", "text": "a"}]}],
            "hooks": [{"id": "w", "event": "before_decision", "condition": "text_only_reply", "action": "warn", "message": "Commit."}]}),
        );
        let forced = spec(
            serde_json::json!({"id": "s2", "parent": "h0", "hooks": [{"id": "commit-stated", "event": "before_decision", "condition": "text_only_reply",
            "action": "force_action", "message": "", "parameters": {"tool": "commit_final_answer", "args": {"answers": ["1"]}}}]}),
        );
        let specs = [HarnessSpec::h0(), example, forced];
        let t = mechanism_table(&specs, None);
        assert!(t.contains("| s1 | 1 examples, 1 hooks | policy-side |"), "{t}");
        assert!(t.contains("| s2 | 1 hooks | harness-side (acts for the policy: commit-stated) |"), "{t}");
        assert!(!t.contains("| h0 |"), "{t}");
        // With the manifest: which editor wrote each sibling.
        let mut m = super::super::pool::PoolManifest::new("r");
        for (id, editor) in [("s1", "learned:ed@2"), ("s2", "template")] {
            m.members.push(super::super::pool::PoolEntry {
                id: id.into(),
                parent: Some("h0".into()),
                generation: 1,
                round: 1,
                direction: None,
                causes: vec![],
                version: String::new(),
                editor: editor.into(),
                local: None,
                validation_coverage: vec![],
                selected_as_parent: false,
                origin_run: "r".into(),
            });
        }
        let t = mechanism_table(&specs, Some(&m));
        assert!(t.contains("| s1 | learned:ed@2 | 1 examples, 1 hooks | policy-side |"), "{t}");
        assert!(t.contains("| s2 | template | 1 hooks |"), "{t}");
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn repairs_regressions_and_the_directed_overlap() {
        let tasks = set(&["1", "2", "3", "4", "5"]);
        let h0 = set(&["1"]);
        let sib = BTreeMap::from([
            ("s1".to_string(), set(&["2", "3"])),
            ("s2".to_string(), set(&["1", "2", "3", "4"])),
            ("s3".to_string(), set(&["1"])),
        ]);
        let c = repair_counts(&tasks, &h0, &sib);
        assert_eq!(c[0].repaired, set(&["2", "3"]));
        assert_eq!(c[0].regressed, set(&["1"]));
        assert_eq!(c[1].repaired, set(&["2", "3", "4"]));
        assert!(c[1].regressed.is_empty());
        let m = overlap_matrix(&c);
        assert_eq!(m[0][1], Some(1.0)); // all of s1's repairs are also s2's
        assert_eq!(m[1][0], Some(2.0 / 3.0)); // but not the other way round
        assert_eq!(m[0][0], None);
        assert_eq!(m[2][0], None); // s3 repairs nothing
        assert_eq!(m[0][2], Some(0.0));
        let mean = mean_overlap(&m).unwrap();
        assert!((mean - (1.0 + 0.0 + 2.0 / 3.0 + 0.0) / 4.0).abs() < 1e-9);
        let table = repair_table(&c);
        assert!(table.contains("| s1 | 2 | 1 | 2, 3 |"), "{table}");
        assert!(table.contains("| s3 | 0 | 0 |  |"), "{table}");
        assert!(
            table.contains("Union of repairs: 3 task(s); 2 distinct non-empty repaired set(s); mean directed repair overlap: 41.7%."),
            "{table}"
        );
    }

    #[test]
    fn figures_are_written_as_png() {
        let dir = tempfile::tempdir().unwrap();
        let tasks = set(&["1", "2", "3"]);
        let sib = BTreeMap::from([("s1".to_string(), set(&["2"])), ("s2".to_string(), set(&["2", "3"]))]);
        let c = repair_counts(&tasks, &set(&["1"]), &sib);
        let a = dir.path().join("fig1a.png");
        let b = dir.path().join("fig5.png");
        plot_repairs(&c, &a).unwrap();
        plot_overlap(&c, &b).unwrap();
        // One sibling, and none, still draw.
        let one = &c[..1];
        let (a1, b1) = (dir.path().join("one1a.png"), dir.path().join("one5.png"));
        plot_repairs(one, &a1).unwrap();
        plot_overlap(one, &b1).unwrap();
        let (a0, b0) = (dir.path().join("none1a.png"), dir.path().join("none5.png"));
        plot_repairs(&[], &a0).unwrap();
        plot_overlap(&[], &b0).unwrap();
        for f in [a, b, a1, b1, a0, b0] {
            let bytes = std::fs::read(&f).unwrap();
            assert_eq!(&bytes[1..4], b"PNG", "{}", f.display());
        }
    }
}
