//! DBBench grading, exactly as AgentBench's `DBResultProcessor` does it (pure functions).
//!
//! - Write tasks (`INSERT`, `UPDATE`, `DELETE`): the table hash after the episode
//!   (see [`hash_query`]) is compared with `answer_md5` after both are cleaned.
//! - Read tasks: the committed answers and the label are cleaned ([`clean_answer`]:
//!   quotes stripped, `%` and thousands commas removed, `none`/`null`/`nan`/`""`/... → `"0"`),
//!   then compared: one value each → both `"0"`, or floats within 0.01, or equal
//!   strings; otherwise all-float lists → multiset match with the same tolerance; otherwise
//!   set equality.

use super::pyvalue::{parse_literal, py_float, py_strip, PyValue};

/// Task types graded by the table hash instead of the answer.
pub const WRITE_TYPES: [&str; 3] = ["INSERT", "DELETE", "UPDATE"];

/// Whether a task type is graded by the table hash.
pub fn is_write_type(task_type: &str) -> bool {
    WRITE_TYPES.contains(&task_type)
}

/// Float tolerance of AgentBench's `_float_equal`.
pub const FLOAT_TOLERANCE: f64 = 1e-2;

/// The outcome of one comparison, with the cleaned values for reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub matched: bool,
    pub answer: Vec<String>,
    pub truth: Vec<String>,
    /// Which rule decided, in words.
    pub rule: &'static str,
}

impl Comparison {
    /// One line for `Evaluation.detail`.
    pub fn describe(&self) -> String {
        format!("{}: answer {:?} vs expected {:?} ({})", if self.matched { "correct" } else { "wrong" }, self.answer, self.truth, self.rule)
    }
}

/// `str.strip("'\"")`.
fn strip_quotes(s: &str) -> &str {
    s.trim_matches(['\'', '"'])
}

/// `str(x).strip().strip("'\"")` followed by `_normalize_special_values`.
fn clean_item(item: &PyValue) -> String {
    let s = item.to_py_str();
    normalize_special(strip_quotes(py_strip(&s)))
}

/// AgentBench's `_normalize_special_values` on `str(value)`: a trailing `%` is dropped
/// (and nothing else is done), commas are removed unless the text is bracketed, and
/// null-like words become `"0"`.
pub fn normalize_special(value: &str) -> String {
    let mut s = py_strip(value).to_string();
    if let Some(body) = s.strip_suffix('%') {
        return py_strip(body).to_string();
    }
    if s.contains(',') && !s.starts_with('[') && !s.ends_with(']') {
        s = s.replace(',', "");
    }
    match s.to_lowercase().as_str() {
        "none" | "null" | "undefined" | "nan" | "inf" | "infinity" | "-inf" | "-infinity" | "" => "0".to_string(),
        _ => s,
    }
}

/// AgentBench's `_clean_mysql_result`: a string that looks like a MySQL result
/// `[(v,), ...]` becomes its single-column values.
fn clean_mysql_result(s: &str) -> Option<Vec<String>> {
    if !(s.starts_with('[') && s.ends_with(']')) {
        return None;
    }
    if let Some(PyValue::List(items)) = parse_literal(s) {
        if items.iter().all(|i| matches!(i, PyValue::Tuple(_))) {
            return Some(
                items
                    .iter()
                    .filter_map(|i| match i {
                        PyValue::Tuple(t) if t.len() == 1 => Some(strip_quotes(py_strip(&t[0].to_py_str())).to_string()),
                        _ => None,
                    })
                    .collect(),
            );
        }
    }
    // The fallback for one tuple `[(v,)]` that `eval` could not read.
    let inner = s.trim_matches(['[', ']']);
    if inner.matches('(').count() == 1 && inner.starts_with('(') && inner.ends_with(",)") {
        let value = &inner[1..inner.len() - 2];
        return Some(vec![strip_quotes(py_strip(value)).to_string()]);
    }
    None
}

/// AgentBench's `_clean_answer`: the list of normalized answer strings.
pub fn clean_answer(answer: &PyValue) -> Vec<String> {
    match answer {
        PyValue::None => vec!["0".to_string()],
        PyValue::Str(s) => {
            if let Some(values) = clean_mysql_result(s) {
                return values.iter().map(|v| normalize_special(v)).collect();
            }
            let s = py_strip(s);
            if s.starts_with('[') && s.ends_with(']') {
                match parse_literal(s) {
                    Some(PyValue::List(items)) => return items.iter().map(clean_list_item).collect(),
                    Some(_) => {}
                    None => return split_unparsed_list(&s[1..s.len() - 1]),
                }
            }
            vec![normalize_special(strip_quotes(py_strip(s)))]
        }
        PyValue::List(items) | PyValue::Tuple(items) => items.iter().map(clean_list_item).collect(),
        other => vec![clean_item(other)],
    }
}

/// One element of a list answer: a 1-tuple is unwrapped.
fn clean_list_item(item: &PyValue) -> String {
    match item {
        PyValue::Tuple(t) if t.len() == 1 => clean_item(&t[0]),
        other => clean_item(other),
    }
}

/// The fallback when `eval` fails on a bracketed answer: split at commas outside
/// quotes; quote characters are dropped.
fn split_unparsed_list(body: &str) -> Vec<String> {
    let mut items = Vec::new();
    let mut current = String::new();
    let mut in_quotes = false;
    for c in body.chars() {
        if c == '"' || c == '\'' {
            in_quotes = !in_quotes;
        } else if c == ',' && !in_quotes {
            if !current.is_empty() {
                items.push(normalize_special(strip_quotes(py_strip(&current))));
                current.clear();
            }
        } else {
            current.push(c);
        }
    }
    if !current.is_empty() {
        items.push(normalize_special(strip_quotes(py_strip(&current))));
    }
    items
}

fn float_equal(a: &str, b: &str) -> bool {
    match (py_float(a), py_float(b)) {
        (Some(a), Some(b)) => (a - b).abs() <= FLOAT_TOLERANCE,
        _ => false,
    }
}

fn is_float(s: &str) -> bool {
    py_float(s).is_some()
}

/// AgentBench's `compare_results(answer, ground_truth, query_type)`.
pub fn compare_results(answer: &PyValue, truth: &PyValue, task_type: &str) -> Comparison {
    let a = clean_answer(answer);
    let t = clean_answer(truth);
    let (matched, rule) = if is_write_type(task_type) {
        (a == t, "table hash equality")
    } else if a.len() == 1 && t.len() == 1 {
        if a[0] == "0" && t[0] == "0" {
            (true, "both empty-like")
        } else if is_float(&a[0]) && is_float(&t[0]) {
            (float_equal(&a[0], &t[0]), "single number within 0.01")
        } else {
            (a[0] == t[0], "single string equality")
        }
    } else if a.iter().all(|x| is_float(x)) && t.iter().all(|x| is_float(x)) {
        if a.len() != t.len() {
            (false, "number lists of different lengths")
        } else {
            // Greedy first-fit, as AgentBench matches.
            let mut used = vec![false; t.len()];
            let mut ok = true;
            for x in &a {
                match (0..t.len()).find(|&i| !used[i] && float_equal(x, &t[i])) {
                    Some(i) => used[i] = true,
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            (ok && used.iter().all(|u| *u), "number multiset within 0.01")
        }
    } else {
        let sa: std::collections::BTreeSet<&String> = a.iter().collect();
        let st: std::collections::BTreeSet<&String> = t.iter().collect();
        (sa == st, "set equality")
    };
    Comparison { matched, answer: a, truth: t, rule }
}

/// AgentBench's per-table hash query: md5 of the sorted 5-hex-digit row hashes.
pub fn hash_query(table: &str, columns: &[String]) -> String {
    let cols: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
    format!(
        "select md5(group_concat(rowhash order by rowhash)) as hash from( SELECT substring(MD5(CONCAT_WS(',', {})), 1, 5) AS rowhash FROM {}) as sub;",
        cols.join(","),
        quote_ident(table)
    )
}

/// The row-hash half of [`hash_query`], for engines that aggregate outside SQL.
pub fn rowhash_query(table: &str, columns: &[String]) -> String {
    let cols: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
    format!("SELECT substring(MD5(CONCAT_WS(',', {})), 1, 5) AS rowhash FROM {}", cols.join(","), quote_ident(table))
}

/// MySQL 8's default `group_concat_max_len`, under which AgentBench's published
/// `answer_md5` values were computed; both engines truncate the concatenation to it.
pub const GROUP_CONCAT_MAX_LEN: usize = 1024;

/// `md5(group_concat(rowhash order by rowhash))` computed outside SQL: sort, join with
/// `,`, cut to [`GROUP_CONCAT_MAX_LEN`] bytes, md5. `None` (SQL NULL) for no rows.
pub fn aggregate_rowhashes(mut rowhashes: Vec<String>) -> Option<String> {
    use md5::{Digest, Md5};
    if rowhashes.is_empty() {
        return None;
    }
    rowhashes.sort();
    let mut joined = rowhashes.join(",");
    if joined.len() > GROUP_CONCAT_MAX_LEN {
        let mut cut = GROUP_CONCAT_MAX_LEN;
        while !joined.is_char_boundary(cut) {
            cut -= 1;
        }
        joined.truncate(cut);
    }
    Some(hex::encode(Md5::digest(joined.as_bytes())))
}

/// What AgentBench compares with `answer_md5`: per-table hashes (`None` → `"None"`),
/// sorted and joined with `_`.
pub fn combine_table_hashes(hashes: &[Option<String>]) -> String {
    let mut parts: Vec<String> = hashes.iter().map(|h| h.clone().unwrap_or_else(|| "None".to_string())).collect();
    parts.sort();
    parts.join("_")
}

/// A MySQL/SQLite identifier in backticks (backticks inside doubled).
pub fn quote_ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> PyValue {
        PyValue::Str(v.to_string())
    }
    fn list(v: &[&str]) -> PyValue {
        PyValue::List(v.iter().map(|x| s(x)).collect())
    }

    #[test]
    fn normalization_follows_agentbench() {
        assert_eq!(normalize_special(" 99.8% "), "99.8");
        assert_eq!(normalize_special("1,234"), "1234");
        assert_eq!(normalize_special("[1,2]"), "[1,2]");
        assert_eq!(normalize_special("None"), "0");
        assert_eq!(normalize_special("NULL"), "0");
        assert_eq!(normalize_special(""), "0");
        assert_eq!(normalize_special("Giza"), "Giza");
        // A trailing % returns early: the comma stays.
        assert_eq!(normalize_special("1,5%"), "1,5");
    }

    #[test]
    fn single_values() {
        assert!(compare_results(&list(&["17"]), &list(&["17"]), "counting").matched);
        assert!(compare_results(&list(&["17.0"]), &list(&["17"]), "counting").matched);
        assert!(compare_results(&list(&["2011.004"]), &list(&["2011.0"]), "aggregation-SUM").matched);
        assert!(!compare_results(&list(&["2011.02"]), &list(&["2011.0"]), "aggregation-SUM").matched);
        assert!(compare_results(&list(&["'Giza'"]), &list(&["Giza"]), "ranking").matched);
        assert!(!compare_results(&list(&["giza"]), &list(&["Giza"]), "ranking").matched);
        assert!(compare_results(&list(&["null"]), &list(&["none"]), "aggregation-MAX").matched);
        assert!(compare_results(&list(&["32,502"]), &list(&["32502.0"]), "aggregation-MAX").matched);
        assert!(compare_results(&PyValue::List(vec![PyValue::Int("17".into())]), &list(&["17"]), "counting").matched);
        assert!(compare_results(&PyValue::List(vec![PyValue::None]), &list(&["none"]), "comparison").matched);
    }

    #[test]
    fn several_values() {
        assert!(compare_results(&list(&["2–0", "1–0"]), &list(&["1–0", "2–0"]), "comparison").matched);
        assert!(!compare_results(&list(&["1–0"]), &list(&["1–0", "2–0"]), "comparison").matched);
        assert!(compare_results(&list(&["2", "1.001"]), &list(&["1", "2"]), "comparison").matched);
        assert!(!compare_results(&list(&["1", "1"]), &list(&["1", "2"]), "comparison").matched);
        // Set equality ignores duplicates for strings.
        assert!(compare_results(&list(&["a", "a", "b"]), &list(&["b", "a"]), "comparison").matched);
    }

    #[test]
    fn string_answers_are_read_like_agentbench() {
        // A MySQL result string.
        assert_eq!(clean_answer(&s("[('Giza',), ('Cairo',)]")), vec!["Giza", "Cairo"]);
        assert_eq!(clean_answer(&s("[(293.0,)]")), vec!["293.0"]);
        // A Python list string.
        assert_eq!(clean_answer(&s("['a', 'b']")), vec!["a", "b"]);
        // Not parseable: split at commas outside quotes.
        assert_eq!(clean_answer(&s("[a, 'b, c', d]")), ["a", "b, c", "d"].iter().map(|x| normalize_special(x)).collect::<Vec<_>>());
        assert_eq!(clean_answer(&s(" 'x' ")), vec!["x"]);
        assert_eq!(clean_answer(&PyValue::None), vec!["0"]);
    }

    #[test]
    fn write_tasks_compare_hash_with_answer_md5() {
        let truth = s("[('09aa8fbf72f39362970f95a1276b957c',)]");
        assert!(compare_results(&s("09aa8fbf72f39362970f95a1276b957c"), &truth, "INSERT").matched);
        assert!(!compare_results(&s("19aa8fbf72f39362970f95a1276b957c"), &truth, "INSERT").matched);
        assert!(!compare_results(&s("None"), &truth, "UPDATE").matched);
    }

    #[test]
    fn rowhash_aggregation_is_mysql_group_concat() {
        assert_eq!(aggregate_rowhashes(vec![]), None);
        // md5("abcde,fffff") with the rows sorted first.
        let h = aggregate_rowhashes(vec!["fffff".into(), "abcde".into()]).unwrap();
        use md5::{Digest, Md5};
        assert_eq!(h, hex::encode(Md5::digest(b"abcde,fffff")));
        // 200 rows exceed 1024 bytes: the concatenation is cut like MySQL 8 cuts it.
        let rows: Vec<String> = (0..200).map(|i| format!("{i:05}")).collect();
        let joined = rows.join(",");
        assert_eq!(aggregate_rowhashes(rows).unwrap(), hex::encode(Md5::digest(&joined.as_bytes()[..1024])));
        assert_eq!(combine_table_hashes(&[Some("b".into()), None]), "None_b");
    }

    #[test]
    fn hash_query_quotes_identifiers() {
        let q = hash_query("My `Table`", &["a b".into(), "c".into()]);
        assert!(q.contains("CONCAT_WS(',', `a b`,`c`)"), "{q}");
        assert!(q.contains("FROM `My ``Table```"), "{q}");
    }
}
