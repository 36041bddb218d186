//! Generated DBBench tasks for the embedded default, so a newcomer needs no download.
//!
//! [`generate`] writes DBBench-format task objects (the same JSONL shape as AgentBench's
//! `dev.jsonl`) over generated tables: counting, aggregation (SUM / AVG / MIN / MAX),
//! ranking, comparison, lookup, INSERT and UPDATE, at three difficulty levels. Every answer is
//! computed by executing the task's gold SQL against SQLite: read labels are the query's
//! values, write tasks carry the `answer_md5` of the table after the gold statement.
//!
//! Difficulty shapes what a small policy can manage:
//! - `easy`: 3–4 rows, a name and one two-digit number column, one condition;
//! - `medium`: 5–8 rows, a category and two two-digit number columns;
//! - `hard`: 10–16 rows, table names with spaces, numbers of mixed width (text
//!   comparison gives wrong answers), two conditions, second-highest rankings.
//!
//! A policy sees the question and the headers, never the rows, so some kinds can be
//! guessed (an easy comparison names its two candidates; a count over 3–4 rows is a small
//! integer) and some cannot: `lookup` (one named row's value, among 8–12 rows at every
//! level; DBBench's type `other`), the SUM / MIN / MAX / AVG of `aggregation`, and `ranking`
//! (a name the question does not give). [`GUESSABLE`] says which.
//!
//! The same seed always gives the same file.

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::grade::{combine_table_hashes, quote_ident};
use super::pyvalue::PyValue;
use super::sqlite::SqliteDb;
use super::task::TableSpec;
use super::ExecSettings;

/// How hard generated tasks are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Difficulty {
    Easy,
    Medium,
    Hard,
}

impl Difficulty {
    pub fn as_str(self) -> &'static str {
        match self {
            Difficulty::Easy => "easy",
            Difficulty::Medium => "medium",
            Difficulty::Hard => "hard",
        }
    }
}

impl std::str::FromStr for Difficulty {
    type Err = GenerateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "easy" => Ok(Difficulty::Easy),
            "medium" => Ok(Difficulty::Medium),
            "hard" => Ok(Difficulty::Hard),
            other => Err(GenerateError::UnknownDifficulty(other.to_string())),
        }
    }
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub seed: u64,
    pub n: usize,
    /// One level for all tasks; `None` mixes easy, medium and hard (2 : 2 : 1).
    pub difficulty: Option<Difficulty>,
    /// Only these task kinds ([`KINDS`]), balanced in turn; empty means [`DEFAULT_KINDS`].
    pub kinds: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GenerateError {
    #[error("unknown difficulty `{0}`: use easy, medium, hard or mixed")]
    UnknownDifficulty(String),
    #[error("--n must be at least 1")]
    NoTasks,
    #[error("--n {0} is more than {MAX_TASKS} tasks, the most one call generates; generate several files with different seeds")]
    TooMany(usize),
    #[error("unknown task kind `{0}`: use counting, aggregation, ranking, comparison, lookup, INSERT or UPDATE")]
    UnknownKind(String),
    /// A generated gold statement failed on SQLite: a bug in the generator.
    #[error("generated task {index} could not be answered on SQLite: {detail}")]
    Unanswerable { index: usize, detail: String },
}

/// The task kinds, one per DBBench type family, and `lookup`.
pub const KINDS: [&str; 7] = ["counting", "aggregation", "ranking", "comparison", "lookup", "INSERT", "UPDATE"];

/// The kinds generated when none are named: the six DBBench families, as before `lookup`
/// existed, so that a seed keeps giving the same file.
pub const DEFAULT_KINDS: [&str; 6] = ["counting", "aggregation", "ranking", "comparison", "INSERT", "UPDATE"];

/// The kinds a policy that never reads a row can answer by chance at `easy` (a comparison
/// names its two candidates, a count over 3–4 rows is 1 to 3); the others need a query.
pub const GUESSABLE: [&str; 2] = ["counting", "comparison"];

/// A number column: its name, how questions call it, and its value range.
struct NumberColumn {
    name: &'static str,
    phrase: &'static str,
    lo: i64,
    hi: i64,
}

/// A table theme.
struct Theme {
    table: &'static str,
    /// The table name at `hard` (with spaces, so it must be quoted).
    hard_table: &'static str,
    singular: &'static str,
    plural: &'static str,
    key: &'static str,
    keys: &'static [&'static str],
    category: &'static str,
    categories: &'static [&'static str],
    numbers: &'static [NumberColumn],
}

const fn num(name: &'static str, phrase: &'static str, lo: i64, hi: i64) -> NumberColumn {
    NumberColumn { name, phrase, lo, hi }
}

const THEMES: &[Theme] = &[
    Theme {
        table: "employees",
        hard_table: "Employee Records",
        singular: "employee",
        plural: "employees",
        key: "name",
        keys: &[
            "Alice", "Bruno", "Chen", "Dana", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Jonas", "Kemal", "Lena", "Mateo", "Nora", "Omar",
            "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wes", "Xenia", "Yusuf", "Zoe",
        ],
        category: "department",
        categories: &["Sales", "IT", "HR", "Finance"],
        numbers: &[num("age", "age", 21, 64), num("years", "years of service", 10, 35), num("salary", "salary", 900, 12000)],
    },
    Theme {
        table: "products",
        hard_table: "Store Inventory",
        singular: "product",
        plural: "products",
        key: "product",
        keys: &[
            "Lamp", "Kettle", "Desk", "Chair", "Mug", "Clock", "Vase", "Rug", "Fan", "Toaster", "Pillow", "Shelf", "Mirror", "Blender",
            "Candle", "Basket", "Stool", "Tray", "Jar", "Bowl", "Plate", "Towel", "Blanket", "Heater",
        ],
        category: "category",
        categories: &["Kitchen", "Garden", "Office", "Bedroom"],
        numbers: &[num("price", "price", 10, 99), num("rating", "rating", 10, 50), num("stock", "units in stock", 0, 1500)],
    },
    Theme {
        table: "students",
        hard_table: "Exam Results",
        singular: "student",
        plural: "students",
        key: "student",
        keys: &[
            "Aiko", "Ben", "Carla", "Deniz", "Eli", "Farah", "Gus", "Ines", "Jack", "Kira", "Liam", "Mia", "Nico", "Olga", "Pablo", "Rhea",
            "Sam", "Tomas", "Uma", "Vic", "Will", "Yara", "Zack", "Ada",
        ],
        category: "class",
        categories: &["A", "B", "C", "D"],
        numbers: &[num("score", "score", 40, 99), num("absences", "absences", 10, 60), num("points", "bonus points", 5, 250)],
    },
    Theme {
        table: "cities",
        hard_table: "City Statistics",
        singular: "city",
        plural: "cities",
        key: "city",
        keys: &[
            "Avalon",
            "Brighton",
            "Cedar Falls",
            "Dover",
            "Elmira",
            "Fairview",
            "Georgetown",
            "Hillsboro",
            "Irvine",
            "Jasper",
            "Kingston",
            "Lakewood",
            "Milton",
            "Newport",
            "Oakdale",
            "Preston",
            "Quincy",
            "Riverside",
            "Salem",
            "Trenton",
        ],
        category: "region",
        categories: &["North", "South", "East", "West"],
        numbers: &[num("area", "area", 10, 99), num("parks", "number of parks", 10, 80), num("population", "population", 800, 98000)],
    },
    Theme {
        table: "players",
        hard_table: "League Players",
        singular: "player",
        plural: "players",
        key: "player",
        keys: &[
            "Abel", "Bako", "Cruz", "Dario", "Enzo", "Felix", "Gael", "Hugo", "Iker", "Joao", "Kofi", "Luka", "Marco", "Nils", "Otto",
            "Pavel", "Rafa", "Saul", "Theo", "Ugo", "Vito", "Yann",
        ],
        category: "team",
        categories: &["Lions", "Tigers", "Bears", "Eagles"],
        numbers: &[num("goals", "goals", 10, 45), num("matches", "matches played", 10, 38), num("minutes", "minutes played", 90, 3400)],
    },
    Theme {
        table: "books",
        hard_table: "Library Catalog",
        singular: "book",
        plural: "books",
        key: "title",
        keys: &[
            "Blue River",
            "Cold Harbor",
            "Dark Forest",
            "Empty Sky",
            "Fading Light",
            "Glass Tower",
            "Hidden Path",
            "Iron Gate",
            "Jade Moon",
            "Kings Road",
            "Lost Island",
            "Night Train",
            "Open Sea",
            "Paper Crown",
            "Quiet Storm",
            "Red Canyon",
            "Silent Bell",
            "Tall Grass",
            "Winter Song",
            "Young Oak",
        ],
        category: "genre",
        categories: &["Mystery", "Fantasy", "History", "Poetry"],
        numbers: &[num("copies", "copies", 10, 90), num("chapters", "chapters", 10, 60), num("pages", "pages", 60, 1200)],
    },
];

/// One generated table with the columns questions refer to.
struct Table {
    spec: TableSpec,
    theme: &'static Theme,
    /// Indexes into `theme.numbers` of the number columns, in column order.
    numbers: Vec<usize>,
    has_category: bool,
}

impl Table {
    fn name_sql(&self) -> String {
        quote_ident(&self.spec.name)
    }
    fn col(&self, name: &str) -> usize {
        self.spec.columns.iter().position(|c| c == name).unwrap_or(0)
    }
    fn values(&self, column: &str) -> Vec<String> {
        let i = self.col(column);
        self.spec.rows.iter().map(|r| r[i].clone()).collect()
    }
    fn ints(&self, column: &str) -> Vec<i64> {
        self.values(column).iter().map(|v| v.parse().unwrap_or(0)).collect()
    }
    /// A category present in the table, preferring one with at least `min` rows.
    fn category_with(&self, rng: &mut ChaCha8Rng, min: usize) -> Option<String> {
        if !self.has_category {
            return None;
        }
        let cats = self.values(self.theme.category);
        let mut options: Vec<&String> = cats.iter().filter(|c| cats.iter().filter(|d| d == c).count() >= min).collect();
        options.sort();
        options.dedup();
        options.choose(rng).map(|c| c.to_string())
    }
}

/// The rows of a `lookup` table below `hard`: enough that a value cannot be told by
/// elimination.
const LOOKUP_ROWS: std::ops::RangeInclusive<usize> = 8..=12;

fn build_table(rng: &mut ChaCha8Rng, difficulty: Difficulty, kind: &str) -> Table {
    let theme = THEMES.choose(rng).unwrap_or(&THEMES[0]);
    let (rows, n_numbers, has_category) = match difficulty {
        Difficulty::Easy if kind == "lookup" => (rng.random_range(LOOKUP_ROWS), 1, false),
        Difficulty::Easy => (rng.random_range(3..=4), 1, false),
        Difficulty::Medium if kind == "lookup" => (rng.random_range(LOOKUP_ROWS), 2, true),
        Difficulty::Medium => (rng.random_range(5..=8), 2, true),
        Difficulty::Hard => (rng.random_range(10..=16), 3, true),
    };
    // Easy and medium use the two-digit columns only, where comparing text happens
    // to give the numeric answer; hard includes the wide-range column.
    let eligible: Vec<usize> = (0..theme.numbers.len()).filter(|&i| difficulty == Difficulty::Hard || theme.numbers[i].hi <= 99).collect();
    let mut numbers: Vec<usize> = eligible.choose_multiple(rng, n_numbers.min(eligible.len())).copied().collect();
    numbers.sort();
    let keys: Vec<&str> = theme.keys.choose_multiple(rng, rows).copied().collect();
    let mut columns = vec![theme.key.to_string()];
    if has_category {
        columns.push(theme.category.to_string());
    }
    columns.extend(numbers.iter().map(|&i| theme.numbers[i].name.to_string()));
    // Distinct values per number column, so rankings have one answer.
    let number_values: Vec<Vec<i64>> = numbers
        .iter()
        .map(|&i| {
            let c = &theme.numbers[i];
            let pool: Vec<i64> = (c.lo..=c.hi).collect();
            pool.choose_multiple(rng, rows).copied().collect()
        })
        .collect();
    let mut table_rows = Vec::with_capacity(rows);
    for (r, key) in keys.iter().enumerate() {
        let mut row = vec![key.to_string()];
        if has_category {
            row.push(theme.categories.choose(rng).unwrap_or(&"A").to_string());
        }
        row.extend(number_values.iter().map(|v| v[r].to_string()));
        table_rows.push(row);
    }
    let name = if difficulty == Difficulty::Hard { theme.hard_table } else { theme.table };
    Table { spec: TableSpec { name: name.to_string(), columns, rows: table_rows }, theme, numbers, has_category }
}

/// One task before its answer is computed.
struct Draft {
    task_type: String,
    description: String,
    gold: String,
}

/// What every draft over one table names: its theme, the quoted table, key and category
/// names, and the number column questions ask about (quoted, with its values sorted).
struct Parts {
    th: &'static Theme,
    tn: String,
    key: String,
    cat_col: String,
    nc: &'static NumberColumn,
    c: String,
    vals: Vec<i64>,
}

fn draft(rng: &mut ChaCha8Rng, t: &Table, kind: &str, difficulty: Difficulty) -> Draft {
    let th = t.theme;
    let tn = t.name_sql();
    let key = quote_ident(th.key);
    let cat_col = quote_ident(th.category);
    let ni = *t.numbers.choose(rng).unwrap_or(&t.numbers[0]);
    let nc = &th.numbers[ni];
    let c = quote_ident(nc.name);
    let mut vals = t.ints(nc.name);
    vals.sort();
    let p = Parts { th, tn, key, cat_col, nc, c, vals };
    match kind {
        "counting" => draft_counting(rng, t, &p, difficulty),
        "aggregation" => draft_aggregation(rng, t, &p, difficulty),
        "ranking" => draft_ranking(rng, t, &p, difficulty),
        "comparison" => draft_comparison(rng, t, &p, difficulty),
        "lookup" => draft_lookup(rng, t, &p),
        "INSERT" => draft_insert(rng, t, &p),
        _ => draft_update(rng, t, &p, difficulty),
    }
}

/// How many rows pass a condition (of the category, at `hard` with a threshold too).
fn draft_counting(rng: &mut ChaCha8Rng, t: &Table, p: &Parts, difficulty: Difficulty) -> Draft {
    let Parts { th, tn, cat_col, nc, c, vals, .. } = p;
    if difficulty == Difficulty::Medium && rng.random_bool(0.5) {
        let cat = t.category_with(rng, 1).unwrap_or_default();
        return Draft {
            task_type: "counting".into(),
            description: format!("How many {} have {} '{cat}'?", th.plural, th.category),
            gold: format!("SELECT COUNT(*) FROM {tn} WHERE {cat_col} = '{cat}'"),
        };
    }
    if difficulty == Difficulty::Hard {
        // A threshold some row of the category reaches, so the count is at least one.
        let cat = t.category_with(rng, 2).or_else(|| t.category_with(rng, 1)).unwrap_or_default();
        let cats = t.values(th.category);
        let in_cat: Vec<i64> = t.ints(nc.name).into_iter().zip(&cats).filter(|(_, c)| **c == cat).map(|(v, _)| v).collect();
        let v = *in_cat.choose(rng).unwrap_or(&vals[0]);
        Draft {
            task_type: "counting".into(),
            description: format!("How many {} with {} '{cat}' have {} of at least {v}?", th.plural, th.category, nc.phrase),
            gold: format!("SELECT COUNT(*) FROM {tn} WHERE {cat_col} = '{cat}' AND {c} + 0 >= {v}"),
        }
    } else {
        // A threshold below the maximum, so the count is at least one.
        let v = vals[rng.random_range(0..vals.len() - 1)];
        Draft {
            task_type: "counting".into(),
            description: format!("How many {} have {} greater than {v}?", th.plural, nc.phrase),
            gold: format!("SELECT COUNT(*) FROM {tn} WHERE {c} + 0 > {v}"),
        }
    }
}

/// SUM, AVG, MIN or MAX of the number column, over a category from `medium` on.
fn draft_aggregation(rng: &mut ChaCha8Rng, t: &Table, p: &Parts, difficulty: Difficulty) -> Draft {
    let Parts { th, tn, cat_col, nc, c, .. } = p;
    let (op, word) =
        *[("SUM", "total"), ("AVG", "average"), ("MIN", "lowest"), ("MAX", "highest")].choose(rng).unwrap_or(&("SUM", "total"));
    let filter = if difficulty == Difficulty::Easy { None } else { t.category_with(rng, 1) };
    let (scope, cond) = match &filter {
        Some(cat) => (format!("{} with {} '{cat}'", th.plural, th.category), format!(" WHERE {cat_col} = '{cat}'")),
        None => (format!("all {}", th.plural), String::new()),
    };
    Draft {
        task_type: format!("aggregation-{op}"),
        description: format!("What is the {word} {} of {scope}?", nc.phrase),
        gold: format!("SELECT {op}({c} + 0) FROM {tn}{cond}"),
    }
}

/// The row with the highest or lowest value; at `hard` within a category, or the second.
fn draft_ranking(rng: &mut ChaCha8Rng, t: &Table, p: &Parts, difficulty: Difficulty) -> Draft {
    let Parts { th, tn, key, cat_col, nc, c, .. } = p;
    let (dir, word) = if rng.random_bool(0.5) { ("DESC", "highest") } else { ("ASC", "lowest") };
    if difficulty != Difficulty::Hard {
        return Draft {
            task_type: "ranking".into(),
            description: format!("Which {} has the {word} {}?", th.singular, nc.phrase),
            gold: format!("SELECT {key} FROM {tn} ORDER BY {c} + 0 {dir} LIMIT 1"),
        };
    }
    match t.category_with(rng, 2) {
        Some(cat) if rng.random_bool(0.5) => Draft {
            task_type: "ranking".into(),
            description: format!("Among {} with {} '{cat}', which {} has the {word} {}?", th.plural, th.category, th.singular, nc.phrase),
            gold: format!("SELECT {key} FROM {tn} WHERE {cat_col} = '{cat}' ORDER BY {c} + 0 {dir} LIMIT 1"),
        },
        _ => Draft {
            task_type: "ranking".into(),
            description: format!("Which {} has the second {word} {}?", th.singular, nc.phrase),
            gold: format!("SELECT {key} FROM {tn} ORDER BY {c} + 0 {dir} LIMIT 1 OFFSET 1"),
        },
    }
}

/// The higher of two rows (`easy`), or every row below a threshold.
fn draft_comparison(rng: &mut ChaCha8Rng, t: &Table, p: &Parts, difficulty: Difficulty) -> Draft {
    let Parts { th, tn, key, nc, c, vals, .. } = p;
    if difficulty == Difficulty::Easy {
        let keys = t.values(th.key);
        let pair: Vec<&String> = keys.choose_multiple(rng, 2).collect();
        let (a, b) = (pair[0], pair[1]);
        Draft {
            task_type: "comparison".into(),
            description: format!("Which {} has a higher {}: {a} or {b}?", th.singular, nc.phrase),
            gold: format!("SELECT {key} FROM {tn} WHERE {key} IN ('{a}', '{b}') ORDER BY {c} + 0 DESC LIMIT 1"),
        }
    } else {
        // Exactly k rows fall below the threshold (values are distinct).
        let k = rng.random_range(1..=3.min(vals.len() - 1));
        let v = vals[k - 1] + 1;
        Draft {
            task_type: "comparison".into(),
            description: format!("Which {} have {} less than {v}? Give every {}.", th.plural, nc.phrase, th.key),
            gold: format!("SELECT {key} FROM {tn} WHERE {c} + 0 < {v}"),
        }
    }
}

/// The value of one named row's number column.
fn draft_lookup(rng: &mut ChaCha8Rng, t: &Table, p: &Parts) -> Draft {
    let Parts { th, tn, key, nc, c, .. } = p;
    let keys = t.values(th.key);
    let who = keys.choose(rng).cloned().unwrap_or_default();
    Draft {
        // DBBench's type for a read that is neither a count, a comparison, a ranking nor
        // an aggregation
        task_type: "other".into(),
        description: format!("What is the {} of the {} {who}?", nc.phrase, th.singular),
        gold: format!("SELECT {c} FROM {tn} WHERE {key} = '{who}'"),
    }
}

/// A new row with a fresh key and a value for every column.
fn draft_insert(rng: &mut ChaCha8Rng, t: &Table, p: &Parts) -> Draft {
    let Parts { th, tn, vals, .. } = p;
    let used = t.values(th.key);
    let fresh: Vec<&&str> = th.keys.iter().filter(|k| !used.iter().any(|u| u == *k)).collect();
    let name = fresh.choose(rng).map(|k| k.to_string()).unwrap_or_else(|| format!("{} {}", th.keys[0], vals.len() + 1));
    let mut values = vec![name.clone()];
    let mut parts = vec![format!("{} '{name}'", th.key)];
    if t.has_category {
        let cat = th.categories.choose(rng).unwrap_or(&"A").to_string();
        parts.push(format!("{} '{cat}'", th.category));
        values.push(cat);
    }
    for &i in &t.numbers {
        let col = &th.numbers[i];
        let v = rng.random_range(col.lo..=col.hi);
        parts.push(format!("{} {v}", col.name));
        values.push(v.to_string());
    }
    let cols: Vec<String> = t.spec.columns.iter().map(|c| quote_ident(c)).collect();
    let quoted: Vec<String> = values.iter().map(|v| format!("'{v}'")).collect();
    Draft {
        task_type: "INSERT".into(),
        description: format!("Insert a new {} into the table {} with {}.", th.singular, t.spec.name, parts.join(", ")),
        gold: format!("INSERT INTO {tn} ({}) VALUES ({})", cols.join(", "), quoted.join(", ")),
    }
}

/// A new value for one row; at `hard`, an increase of every row of a category.
fn draft_update(rng: &mut ChaCha8Rng, t: &Table, p: &Parts, difficulty: Difficulty) -> Draft {
    let Parts { th, tn, key, cat_col, nc, c, .. } = p;
    if difficulty == Difficulty::Hard {
        if let Some(cat) = t.category_with(rng, 1) {
            let d = rng.random_range(2..=9);
            return Draft {
                task_type: "UPDATE".into(),
                description: format!("Increase the {} of every {} with {} '{cat}' by {d}.", nc.phrase, th.singular, th.category),
                gold: format!("UPDATE {tn} SET {c} = {c} + {d} WHERE {cat_col} = '{cat}'"),
            };
        }
    }
    let keys = t.values(th.key);
    let who = keys.choose(rng).cloned().unwrap_or_default();
    let current = t.ints(nc.name)[keys.iter().position(|k| *k == who).unwrap_or(0)];
    let mut v = rng.random_range(nc.lo..=nc.hi);
    if v == current {
        v = if v < nc.hi { v + 1 } else { v - 1 };
    }
    Draft {
        task_type: "UPDATE".into(),
        description: format!("Change the {} of the {} {who} to {v}.", nc.phrase, th.singular),
        gold: format!("UPDATE {tn} SET {c} = '{v}' WHERE {key} = '{who}'"),
    }
}

/// Computes the answer of a draft on SQLite and assembles the DBBench task object.
fn finish(index: usize, seed: u64, t: &Table, d: Draft, difficulty: Difficulty) -> Result<Value, GenerateError> {
    let err = |detail: String| GenerateError::Unanswerable { index, detail };
    let tables = std::slice::from_ref(&t.spec);
    let mut db = SqliteDb::create(tables).map_err(|e| err(e.to_string()))?;
    let is_write = d.task_type == "INSERT" || d.task_type == "UPDATE";
    let columns: Vec<Value> = t
        .spec
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"name": c, "type": if i == 0 || (t.has_category && i == 1) { "TEXT" } else { "INT" }}))
        .collect();
    let mut task = json!({
        "id": format!("gen-{seed}-{index}"),
        "description": d.description,
        "table": {"table_name": t.spec.name, "table_info": {"columns": columns, "rows": t.spec.rows}},
        "add_description": format!(
            "The name of this table is {}, and the headers of this table are {}.",
            t.spec.name,
            t.spec.columns.join(",")
        ),
        "type": [d.task_type],
        "difficulty": difficulty.as_str(),
        "source": "harness-s-generate",
    });
    if is_write {
        let settings = ExecSettings { result_chars: usize::MAX, timeout: std::time::Duration::from_secs(10) };
        if let super::Exec::Failed { text } = db.execute(&d.gold, settings) {
            return Err(err(format!("{}: {text}", d.gold)));
        }
        let hash = db.table_hash(&t.spec).map_err(err)?;
        task["label"] = json!([d.gold]);
        task["answer_md5"] = json!(format!("[('{}',)]", combine_table_hashes(&[hash])));
    } else {
        let rows = db.query_values(&d.gold).map_err(|e| err(format!("{}: {e}", d.gold)))?;
        let label: Vec<String> = rows.iter().flatten().map(PyValue::to_py_str).collect();
        if label.is_empty() {
            return Err(err(format!("{} returned no rows", d.gold)));
        }
        task["label"] = json!(label);
        task["sql"] = json!({"query": d.gold});
    }
    Ok(task)
}

/// The most tasks one call generates (`tasks generate --n`, `env serve --generate`).
pub const MAX_TASKS: usize = 1_000_000;

impl GenerateOptions {
    /// Checks the count and the kinds; returns the kinds to generate.
    pub fn check(&self) -> Result<Vec<&'static str>, GenerateError> {
        if self.n == 0 {
            return Err(GenerateError::NoTasks);
        }
        if self.n > MAX_TASKS {
            return Err(GenerateError::TooMany(self.n));
        }
        if self.kinds.is_empty() {
            return Ok(DEFAULT_KINDS.to_vec());
        }
        self.kinds
            .iter()
            .map(|k| KINDS.iter().copied().find(|known| known == k).ok_or_else(|| GenerateError::UnknownKind(k.clone())))
            .collect()
    }
}

/// Generates `n` tasks from `seed` (see the module docs).
pub fn generate(opts: &GenerateOptions) -> Result<Vec<Value>, GenerateError> {
    let mut tasks = Vec::new();
    for_each_task(opts, |t| {
        tasks.push(t);
        Ok::<(), GenerateError>(())
    })?;
    Ok(tasks)
}

/// Generates the tasks of [`generate`] one after another, handing each to `each` as it
/// is made (a file of a million tasks is written as it grows, never held in memory).
/// Returns how many were made.
pub fn for_each_task<E: From<GenerateError>>(opts: &GenerateOptions, mut each: impl FnMut(Value) -> Result<(), E>) -> Result<usize, E> {
    let chosen = opts.check()?;
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    // Balanced kinds, in a seeded order (one byte per task: the kind's index).
    let mut kinds: Vec<u8> = (0..opts.n).map(|i| (i % chosen.len()) as u8).collect();
    kinds.shuffle(&mut rng);
    for (index, kind) in kinds.into_iter().enumerate() {
        let kind = chosen[usize::from(kind)];
        let difficulty = opts.difficulty.unwrap_or_else(|| match rng.random_range(0..5) {
            0 | 1 => Difficulty::Easy,
            2 | 3 => Difficulty::Medium,
            _ => Difficulty::Hard,
        });
        let table = build_table(&mut rng, difficulty, kind);
        let d = draft(&mut rng, &table, kind, difficulty);
        each(finish(index, opts.seed, &table, d, difficulty)?)?;
    }
    Ok(opts.n)
}

/// [`generate`] as JSONL text (one task per line).
/// The seed of split `split` (0 train, 1 validation, 2 test) of a run spec's
/// `[tasks.generate]` with `seed`: `harness-s env serve --generate T,V,T` uses the same, so a
/// run over HTTP sees the tasks an in-process run generates.
pub fn split_seed(seed: u64, split: usize) -> u64 {
    seed.wrapping_mul(3).wrapping_add(split as u64)
}

pub fn generate_jsonl(opts: &GenerateOptions) -> Result<String, GenerateError> {
    let mut out = String::new();
    for t in generate(opts)? {
        out.push_str(&t.to_string());
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::check::check_tasks;
    use super::super::{DbBenchConfig, TaskSet};
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_tasks() {
        let a = generate_jsonl(&GenerateOptions { seed: 7, n: 30, difficulty: None, kinds: vec![] }).unwrap();
        let b = generate_jsonl(&GenerateOptions { seed: 7, n: 30, difficulty: None, kinds: vec![] }).unwrap();
        let c = generate_jsonl(&GenerateOptions { seed: 8, n: 30, difficulty: None, kinds: vec![] }).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(generate(&GenerateOptions { seed: 1, n: 0, difficulty: None, kinds: vec![] }), Err(GenerateError::NoTasks));
        let too_many = GenerateOptions { seed: 1, n: MAX_TASKS + 1, difficulty: None, kinds: vec![] };
        assert_eq!(generate(&too_many), Err(GenerateError::TooMany(MAX_TASKS + 1)));
        assert!(GenerateError::TooMany(MAX_TASKS + 1).to_string().starts_with("--n "));
        // streaming gives the same tasks as the whole list
        let mut streamed = String::new();
        for_each_task(&GenerateOptions { seed: 7, n: 30, difficulty: None, kinds: vec![] }, |t| {
            streamed.push_str(&format!("{t}\n"));
            Ok::<(), GenerateError>(())
        })
        .unwrap();
        assert_eq!(streamed, a);
    }

    #[test]
    fn tasks_load_cover_every_kind_and_level() {
        let all = KINDS.map(String::from).to_vec();
        let text = generate_jsonl(&GenerateOptions { seed: 3, n: 120, difficulty: None, kinds: all }).unwrap();
        let loaded = TaskSet::parse(&text, "gen.jsonl", "gen");
        // no kinds named: the six DBBench families, no lookup
        let default = generate(&GenerateOptions { seed: 3, n: 60, difficulty: None, kinds: vec![] }).unwrap();
        assert!(default.iter().all(|t| t["type"][0] != "other"));
        assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
        assert_eq!(loaded.tasks.len(), 120);
        let types: std::collections::BTreeSet<String> = loaded.tasks.iter().map(|t| t.task_type.clone()).collect();
        for want in ["counting", "ranking", "comparison", "other", "INSERT", "UPDATE"] {
            assert!(types.contains(want), "{want} missing from {types:?}");
        }
        assert!(types.iter().any(|t| t.starts_with("aggregation-")));
        for level in ["easy", "medium", "hard"] {
            assert!(loaded.tasks.iter().any(|t| t.difficulty.as_deref() == Some(level)), "{level} missing");
        }
        // Easy tables are small, but for a lookup (`other`).
        for t in loaded.tasks.iter().filter(|t| t.difficulty.as_deref() == Some("easy") && t.task_type != "other") {
            assert!(t.row_count() <= 4 && t.tables[0].columns.len() == 2, "{}", t.id);
        }
    }

    #[test]
    fn a_lookup_asks_for_one_named_rows_value_among_eight_or_more() {
        for level in [Difficulty::Easy, Difficulty::Medium, Difficulty::Hard] {
            let opts = GenerateOptions { seed: 5, n: 30, difficulty: Some(level), kinds: vec!["lookup".into()] };
            let text = generate_jsonl(&opts).unwrap();
            let loaded = TaskSet::parse(&text, "gen.jsonl", "gen");
            assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
            for t in loaded.tasks.iter() {
                assert_eq!(t.task_type, "other", "a lookup is DBBench's `other`");
                assert!(t.row_count() >= 8, "{}: {} rows", t.id, t.row_count());
                // the question names the row; the label is its value, found in that row only
                let table = &t.tables[0];
                let row = table.rows.iter().find(|r| t.description.contains(&format!(" {}?", r[0]))).expect("the question names a row");
                let want = t.label[0].as_str().unwrap_or_default();
                assert!(row[1..].iter().any(|v| v == want), "{}: {want:?} not in {row:?}", t.id);
            }
        }
        // not a kind a guess answers
        assert!(!GUESSABLE.contains(&"lookup") && KINDS.contains(&"lookup"));
    }

    #[tokio::test]
    async fn every_generated_answer_is_graded_correct_on_sqlite() {
        let text = generate_jsonl(&GenerateOptions { seed: 11, n: 60, difficulty: None, kinds: KINDS.map(String::from).to_vec() }).unwrap();
        let loaded = TaskSet::parse(&text, "gen.jsonl", "gen");
        let report = check_tasks(Arc::new(loaded.tasks), &DbBenchConfig::sqlite(), false, |_| {}).await.unwrap();
        let bad: Vec<_> = report.checks.iter().filter(|c| !c.agreed).collect();
        assert!(bad.is_empty(), "{bad:#?}");
        assert_eq!(report.checks.len(), 60);
    }
}
