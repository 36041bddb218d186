//! DBBench tasks: the AgentBench JSONL format, read line by line.
//!
//! Each line holds `description`, `label` (answers; for writes the gold SQL), `table`
//! (one table or a list: `table_name`, `table_info.columns[{name,type}]`,
//! `table_info.rows`), `add_description`, `evidence`, `type` (e.g. `["counting"]`),
//! `answer_md5` (writes: `"[('<md5>',)]"`), `sql.query` (reads; often not valid SQL) and
//! `source`. A malformed line is reported with its file and line number and skipped;
//! the other lines still load ([`TaskSet::load`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::grade::is_write_type;
use super::pyvalue::PyValue;

/// One table of a task, with every value already as the text AgentBench inserts
/// (`str(value)` of the JSON value).
#[derive(Debug, Clone, PartialEq)]
pub struct TableSpec {
    pub name: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// One DBBench task.
#[derive(Debug, Clone, PartialEq)]
pub struct DbTask {
    /// `id` from the line, else `<file stem>-<line number>`.
    pub id: String,
    /// The file and line it came from (`dev.jsonl:3`), for messages.
    pub origin: String,
    pub description: String,
    pub add_description: String,
    pub evidence: String,
    /// `type[0]`: `counting`, `INSERT`, ...
    pub task_type: String,
    pub label: serde_json::Value,
    pub answer_md5: Option<String>,
    /// `sql.query` when present.
    pub sql_query: Option<String>,
    pub source: String,
    pub difficulty: Option<String>,
    pub tables: Vec<TableSpec>,
}

impl DbTask {
    /// Graded by the table hash (INSERT / UPDATE / DELETE).
    pub fn is_write(&self) -> bool {
        is_write_type(&self.task_type)
    }

    /// The gold statements of a write task: the label's strings, else `sql.query`.
    pub fn gold_sql(&self) -> Vec<String> {
        let from_label: Vec<String> = match &self.label {
            serde_json::Value::Array(items) => items.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
            serde_json::Value::String(s) => vec![s.clone()],
            _ => Vec::new(),
        };
        let from_label: Vec<String> = from_label.into_iter().filter(|s| !s.trim().is_empty()).collect();
        if !from_label.is_empty() {
            return from_label;
        }
        self.sql_query.iter().cloned().collect()
    }

    /// The label as the Python value AgentBench compares against.
    pub fn label_value(&self) -> PyValue {
        PyValue::from_json(&self.label)
    }

    /// The first user message, as AgentBench builds it.
    pub fn prompt(&self) -> String {
        let mut p = String::new();
        if !self.evidence.is_empty() {
            p.push_str(&format!("Evidence about the question: {}\n", self.evidence));
        }
        if !self.add_description.is_empty() {
            p.push_str(&format!("Additional table information about the question: {}\n", self.add_description));
        }
        p.push_str(&format!("Question: {}\n", self.description));
        p
    }

    /// Total rows over the task's tables.
    pub fn row_count(&self) -> usize {
        self.tables.iter().map(|t| t.rows.len()).sum()
    }
}

/// A line that could not be loaded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub struct LineProblem {
    pub file: String,
    /// 1-based.
    pub line: usize,
    pub message: String,
}

/// A task file that could not be read at all.
#[derive(Debug, thiserror::Error)]
#[error("cannot read task file {}: {source} (pass a DBBench-format JSONL file, e.g. tests/data/dbbench/dev.jsonl, or create one with `harness-s tasks generate`)", path.display())]
pub struct TaskFileError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Tasks by id, in file order.
#[derive(Debug, Clone, Default)]
pub struct TaskSet {
    tasks: Vec<Arc<DbTask>>,
    by_id: HashMap<String, usize>,
}

/// What [`TaskSet::load`] found: the tasks that loaded and one problem per bad line.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub tasks: TaskSet,
    pub problems: Vec<LineProblem>,
}

impl TaskSet {
    /// Reads a JSONL file (or a JSON array file). Bad lines become [`LineProblem`]s.
    pub fn load(path: &Path) -> Result<Loaded, TaskFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TaskFileError { path: path.to_path_buf(), source })?;
        let file = path.display().to_string();
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "tasks".into());
        Ok(Self::parse(&text, &file, &stem))
    }

    /// Parses JSONL text; `file` names it in problems, `stem` prefixes default ids.
    pub fn parse(text: &str, file: &str, stem: &str) -> Loaded {
        let mut loaded = Loaded::default();
        let trimmed = text.trim_start();
        // AgentBench also accepts one JSON array.
        if trimmed.starts_with('[') {
            match serde_json::from_str::<Vec<serde_json::Value>>(trimmed) {
                Ok(items) => {
                    for (i, item) in items.into_iter().enumerate() {
                        loaded.add(item, file, stem, i + 1);
                    }
                }
                Err(e) => loaded.problems.push(LineProblem {
                    file: file.into(),
                    line: e.line(),
                    message: format!("not a JSON array of tasks: {e}"),
                }),
            }
            return loaded;
        }
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) => loaded.add(v, file, stem, i + 1),
                Err(e) => loaded.problems.push(LineProblem {
                    file: file.into(),
                    line: i + 1,
                    message: format!("not valid JSON ({e}); every line must be one task object"),
                }),
            }
        }
        loaded
    }

    /// Builds a set from tasks already in memory (ids must be unique).
    pub fn from_tasks(tasks: Vec<DbTask>) -> Result<TaskSet, String> {
        let mut set = TaskSet::default();
        for t in tasks {
            if set.by_id.contains_key(&t.id) {
                return Err(format!("task id `{}` appears twice", t.id));
            }
            set.by_id.insert(t.id.clone(), set.tasks.len());
            set.tasks.push(Arc::new(t));
        }
        Ok(set)
    }

    pub fn get(&self, id: &str) -> Option<&Arc<DbTask>> {
        self.by_id.get(id).map(|&i| &self.tasks[i])
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<DbTask>> {
        self.tasks.iter()
    }

    pub fn ids(&self) -> Vec<String> {
        self.tasks.iter().map(|t| t.id.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
}

impl Loaded {
    fn add(&mut self, value: serde_json::Value, file: &str, stem: &str, line: usize) {
        let result = parse_task(value, stem, line).and_then(|mut t| {
            t.origin = format!("{file}:{line}");
            if self.tasks.by_id.contains_key(&t.id) {
                return Err(format!("task id `{}` appears twice; ids must be unique", t.id));
            }
            Ok(t)
        });
        match result {
            Ok(t) => {
                self.tasks.by_id.insert(t.id.clone(), self.tasks.tasks.len());
                self.tasks.tasks.push(Arc::new(t));
            }
            Err(message) => self.problems.push(LineProblem { file: file.into(), line, message }),
        }
    }
}

/// The raw line, as far as serde checks shapes.
#[derive(Deserialize, Serialize)]
struct RawTask {
    #[serde(default)]
    id: Option<serde_json::Value>,
    description: String,
    #[serde(default)]
    label: serde_json::Value,
    #[serde(deserialize_with = "table_field")]
    table: OneOrMany<RawTable>,
    #[serde(default)]
    add_description: Option<String>,
    #[serde(default)]
    evidence: Option<String>,
    #[serde(rename = "type", deserialize_with = "type_field")]
    task_type: OneOrMany<String>,
    #[serde(default)]
    answer_md5: Option<String>,
    #[serde(default)]
    sql: Option<serde_json::Value>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    difficulty: Option<String>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

/// One value or a list of them; the error names `field` and what was wrong, instead of
/// serde's "did not match any variant of untagged enum".
fn one_or_many<'de, D: serde::Deserializer<'de>, T: serde::de::DeserializeOwned>(
    d: D,
    field: &str,
    what: &str,
) -> Result<OneOrMany<T>, D::Error> {
    use serde::de::Error;
    let v = serde_json::Value::deserialize(d)?;
    let shape = crate::harness::validate::type_name;
    match v {
        serde_json::Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, x)| {
                let got = shape(&x);
                serde_json::from_value(x).map_err(|e| D::Error::custom(format!("field `{field}`[{i}]: expected {what}, got {got} ({e})")))
            })
            .collect::<Result<Vec<T>, _>>()
            .map(OneOrMany::Many),
        other => {
            let got = shape(&other);
            serde_json::from_value(other)
                .map(OneOrMany::One)
                .map_err(|e| D::Error::custom(format!("field `{field}`: expected {what} or a list of them, got {got} ({e})")))
        }
    }
}

fn table_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<OneOrMany<RawTable>, D::Error> {
    one_or_many(d, "table", "a table object ({\"table_name\", \"table_info\": {\"columns\", \"rows\"}})")
}

fn type_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<OneOrMany<String>, D::Error> {
    one_or_many(d, "type", "a task type string")
}

impl<T> OneOrMany<T> {
    fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Serialize)]
struct RawTable {
    table_name: String,
    table_info: RawTableInfo,
}

#[derive(Deserialize, Serialize)]
struct RawTableInfo {
    columns: Vec<RawColumn>,
    #[serde(default)]
    rows: Vec<Vec<serde_json::Value>>,
}

#[derive(Deserialize, Serialize)]
struct RawColumn {
    name: String,
    #[serde(rename = "type", default)]
    column_type: Option<String>,
}

/// The task types of AgentBench's DBBench: reads are graded by their answers, the writes of
/// [`WRITE_TYPES`](super::grade::WRITE_TYPES) by the table they leave.
pub const TASK_TYPES: [&str; 11] = [
    "other",
    "counting",
    "comparison",
    "ranking",
    "aggregation-SUM",
    "aggregation-MIN",
    "aggregation-MAX",
    "aggregation-AVG",
    "INSERT",
    "UPDATE",
    "DELETE",
];

/// The levels a task's optional `difficulty` may name (those `tasks generate` writes).
pub const DIFFICULTIES: [&str; 3] = ["easy", "medium", "hard"];

fn parse_task(value: serde_json::Value, stem: &str, line: usize) -> Result<DbTask, String> {
    if !value.is_object() {
        return Err("a task must be a JSON object".into());
    }
    let raw: RawTask = serde_json::from_value(value).map_err(|e| format!("not a DBBench task: {e}"))?;
    let id = match raw.id {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s,
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(other) if !other.is_null() => return Err(format!("field `id` must be a string or number, got {other}")),
        _ => format!("{stem}-{line}"),
    };
    let task_type = raw.task_type.into_vec().into_iter().next().filter(|t| !t.is_empty());
    let Some(task_type) = task_type else {
        return Err("field `type` must name the task type, e.g. [\"counting\"] or [\"INSERT\"]".into());
    };
    if !TASK_TYPES.contains(&task_type.as_str()) {
        let hint =
            TASK_TYPES.iter().find(|t| t.eq_ignore_ascii_case(&task_type)).map(|t| format!(" (did you mean `{t}`?)")).unwrap_or_default();
        return Err(format!("field `type`: `{task_type}` is not a DBBench task type{hint}; expected one of: {}", TASK_TYPES.join(", ")));
    }
    let has_object = |v: &serde_json::Value| v.is_object() || v.as_array().is_some_and(|a| a.iter().any(|x| x.is_object() || x.is_array()));
    if has_object(&raw.label) {
        return Err(
            "field `label` must hold the answers as a list of strings or numbers, e.g. [\"2\"] (or the gold SQL of a write task)".into()
        );
    }
    let mut tables = Vec::new();
    for (ti, t) in raw.table.into_vec().into_iter().enumerate() {
        if t.table_name.is_empty() {
            return Err(format!("table {ti}: `table_name` is empty"));
        }
        if t.table_info.columns.is_empty() {
            return Err(format!("table `{}`: `table_info.columns` is empty", t.table_name));
        }
        let mut columns: Vec<String> = t.table_info.columns.into_iter().map(|c| c.name).collect();
        // Servers refuse an empty column name (AgentBench's dev split has one); it
        // becomes `column_<position>`.
        for i in 0..columns.len() {
            if columns[i].trim().is_empty() {
                let mut name = format!("column_{}", i + 1);
                while columns.iter().any(|c| c.eq_ignore_ascii_case(&name)) {
                    name.push('_');
                }
                columns[i] = name;
            }
        }
        let mut seen = std::collections::HashSet::new();
        for c in &columns {
            // Both engines compare column names case-insensitively.
            if !seen.insert(c.to_lowercase()) {
                return Err(format!("table `{}`: column `{c}` appears twice", t.table_name));
            }
        }
        let mut rows = Vec::with_capacity(t.table_info.rows.len());
        for (ri, row) in t.table_info.rows.into_iter().enumerate() {
            if row.len() != columns.len() {
                return Err(format!(
                    "table `{}`: row {ri} has {} values but the table has {} columns",
                    t.table_name,
                    row.len(),
                    columns.len()
                ));
            }
            if let Some((ci, cell)) = row.iter().enumerate().find(|(_, v)| v.is_array() || v.is_object()) {
                return Err(format!(
                    "table `{}`: row {ri}, column `{}` holds {}; a cell is a string, a number, true/false or null",
                    t.table_name,
                    columns[ci],
                    crate::harness::validate::type_name(cell)
                ));
            }
            // AgentBench inserts `str(value)` of every JSON value.
            rows.push(row.iter().map(|v| PyValue::from_json(v).to_py_str()).collect());
        }
        tables.push(TableSpec { name: t.table_name, columns, rows });
    }
    if tables.is_empty() {
        return Err("field `table` holds no table".into());
    }
    if let Some(d) = raw.difficulty.as_deref().filter(|d| !DIFFICULTIES.contains(d)) {
        return Err(format!("field `difficulty`: `{d}` is not one of {} (or leave it out)", DIFFICULTIES.join(", ")));
    }
    let sql_query = match raw.sql {
        Some(serde_json::Value::Object(m)) => m.get("query").and_then(|q| q.as_str()).map(str::to_string),
        Some(serde_json::Value::String(s)) => Some(s),
        _ => None,
    };
    let task = DbTask {
        id,
        origin: String::new(),
        description: raw.description,
        add_description: raw.add_description.unwrap_or_default(),
        evidence: raw.evidence.unwrap_or_default(),
        task_type,
        label: raw.label,
        answer_md5: raw.answer_md5,
        sql_query,
        source: raw.source.unwrap_or_default(),
        difficulty: raw.difficulty,
        tables,
    };
    if task.is_write() {
        let has_md5 = task.answer_md5.as_deref().is_some_and(|m| !m.is_empty());
        if !has_md5 && task.gold_sql().is_empty() {
            return Err(format!("{} task has neither `answer_md5` nor gold SQL (`label` or `sql.query`) to grade against", task.task_type));
        }
    } else if task.label.is_null() {
        return Err(format!("{} task has no `label` (the expected answers)", task.task_type));
    }
    Ok(task)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"description": "How many?", "label": ["2"], "table": {"table_name": "t", "table_info": {"columns": [{"name": "a", "type": "TEXT"}, {"name": "b", "type": "INT"}], "rows": [["x", 1], ["y", null]]}}, "add_description": "The name of this table is t.", "type": ["counting"], "sql": {"query": "SELECT count(*) FROM t"}, "source": "test"}"#;

    #[test]
    fn a_malformed_line_is_reported_and_the_rest_load() {
        let text =
            format!("{GOOD}\n{{not json\n\n{}\n", GOOD.replace("\"type\": [\"counting\"]", "\"id\": \"x7\", \"type\": [\"counting\"]"));
        let loaded = TaskSet::parse(&text, "tasks.jsonl", "tasks");
        assert_eq!(loaded.tasks.len(), 2);
        assert_eq!(loaded.problems.len(), 1);
        assert_eq!(loaded.problems[0].line, 2);
        assert!(loaded.problems[0].to_string().starts_with("tasks.jsonl:2: not valid JSON"), "{}", loaded.problems[0]);
        assert_eq!(loaded.tasks.ids(), vec!["tasks-1", "x7"]);
        let t = loaded.tasks.get("tasks-1").unwrap();
        assert_eq!(t.origin, "tasks.jsonl:1");
        // str(value) of the JSON values, as AgentBench inserts them.
        assert_eq!(t.tables[0].rows, vec![vec!["x", "1"], vec!["y", "None"]]);
        assert_eq!(t.tables[0].columns, vec!["a", "b"]);
        assert_eq!(t.prompt(), "Additional table information about the question: The name of this table is t.\nQuestion: How many?\n");
    }

    #[test]
    fn shape_problems_name_the_field() {
        let cases = [
            (GOOD.replace("[\"x\", 1]", "[\"x\"]"), "row 0 has 1 values"),
            (GOOD.replace("\"type\": [\"counting\"]", "\"type\": []"), "field `type`"),
            (GOOD.replace("{\"name\": \"b\"", "{\"name\": \"A\""), "column `A` appears twice"),
            (GOOD.replace("\"description\": \"How many?\", ", ""), "missing field `description`"),
            (
                GOOD.replace("\"type\": [\"counting\"]", "\"type\": 5"),
                "field `type`: expected a task type string or a list of them, got a number",
            ),
            (
                GOOD.replace("\"type\": [\"counting\"]", "\"type\": [\"counting\", 7]"),
                "field `type`[1]: expected a task type string, got a number",
            ),
            (
                GOOD.replace("\"counting\"", "\"INSERT\"")
                    .replace("\"label\": [\"2\"], ", "")
                    .replace(", \"sql\": {\"query\": \"SELECT count(*) FROM t\"}", ""),
                "neither `answer_md5` nor gold SQL",
            ),
            (GOOD.replace("[\"x\", 1]", "[\"x\", [1, 2]]"), "row 0, column `b` holds an array"),
            (GOOD.replace("[\"y\", null]", "[{\"a\": 1}, null]"), "row 1, column `a` holds an object"),
            (
                GOOD.replace("\"source\": \"test\"", "\"source\": \"test\", \"difficulty\": \"impossible\""),
                "field `difficulty`: `impossible`",
            ),
        ];
        for (line, want) in cases {
            let loaded = TaskSet::parse(&line, "f.jsonl", "f");
            assert_eq!(loaded.tasks.len(), 0, "{want}");
            assert!(loaded.problems[0].message.contains(want), "{} should contain {want}", loaded.problems[0].message);
        }
    }

    #[test]
    fn an_empty_column_name_gets_a_positional_name() {
        let loaded = TaskSet::parse(&GOOD.replace("{\"name\": \"a\"", "{\"name\": \"\""), "f.jsonl", "f");
        assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
        assert_eq!(loaded.tasks.get("f-1").unwrap().tables[0].columns, vec!["column_1", "b"]);
    }

    #[test]
    fn duplicate_ids_are_problems() {
        let line = GOOD.replace("\"type\"", "\"id\": 5, \"type\"");
        let loaded = TaskSet::parse(&format!("{line}\n{line}\n"), "f.jsonl", "f");
        assert_eq!(loaded.tasks.ids(), vec!["5"]);
        assert_eq!(loaded.problems[0].line, 2);
    }
}
