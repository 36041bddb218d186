//! What a DBBench reply or result states, read with the same patterns everywhere: the
//! template editor puts them into harness hooks (`parameters.extract`), and the rule-based
//! diagnoser uses them to name the causes those hooks repair, so a cause is only named when
//! its repair could act on it.

use std::sync::LazyLock;

use regex::Regex;

/// SQL a reply wrote outside a ```sql block: the first SELECT / INSERT / UPDATE / DELETE
/// statement, up to `;`, a code fence, a blank line or the end.
pub const STATED_SQL_PATTERN: &str = r"(?is)\b((?:SELECT|INSERT\s+INTO|UPDATE|DELETE\s+FROM)\b[^;`]*?)\s*(?:;|```|\n\s*\n|$)";
/// The answer a reply states: the words after "answer is" / "answer:", without quotes, up to
/// the end of the line or of the sentence (a full stop before a space; `45.75` stays whole).
pub const STATED_ANSWER_PATTERN: &str =
    r#"(?i)\banswer\b[^:\n]{0,12}?(?:\bis\b|:)\s*:?\s*["'“*]*([^"'”*\n]{1,60}?)["'”*]*\s*(?:\.(?:\s|$)|\n|$)"#;
/// A name the reply gives as its answer: capitalised words after "answer is" (or opening
/// the reply), followed by has / is / was or the end of the sentence.
pub const STATED_NAME_PATTERN: &str = r#"(?:(?i:answer)[^:\n]{0,20}?(?i:is|:)\s*:?\s*|^\s*)["'*]*([A-Z][A-Za-z0-9_'-]*(?:\s+[A-Z][A-Za-z0-9_'-]*){0,2})["'*]*(?:\s+(?:has|had|is|was)\s|\s*[."\n]|$)"#;
/// The first number after "answer", "is", "are", "was", "total" or "of".
pub const STATED_NUMBER_PATTERN: &str = r"(?i)(?:answer|is|are|was|total|of)\s[^.\n0-9]{0,40}?(-?[0-9]+(?:\.[0-9]+)?)";
/// The value of a one-row, one-column DBBench result: `[(2,)]` → 2, `[('Sam',)]` → Sam.
pub const SINGLE_VALUE_PATTERN: &str = r"^\s*\[\(\s*'?([^()]*?)'?\s*,\s*\)\]\s*$";

static STATED_SQL: LazyLock<Regex> = LazyLock::new(|| Regex::new(STATED_SQL_PATTERN).expect("STATED_SQL_PATTERN compiles"));
static SINGLE_VALUE: LazyLock<Regex> = LazyLock::new(|| Regex::new(SINGLE_VALUE_PATTERN).expect("SINGLE_VALUE_PATTERN compiles"));

/// The SQL statement a prose reply wrote outside a ```sql block (with its `;`, if any).
pub fn stated_sql(text: &str) -> Option<&str> {
    STATED_SQL.find(text).map(|m| m.as_str().trim_end().trim_end_matches("```").trim_end())
}

/// The value of a one-row, one-column result (`None` for a NULL value).
pub fn single_value(text: &str) -> Option<&str> {
    let value = SINGLE_VALUE.captures(text)?.get(1)?.as_str().trim();
    (value != "None").then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_readers_find_sql_in_prose_and_single_values() {
        assert_eq!(
            stated_sql("Shorter version:\nSELECT COUNT(*) FROM cities WHERE area > 25;"),
            Some("SELECT COUNT(*) FROM cities WHERE area > 25;")
        );
        assert_eq!(stated_sql("The selected city is Oslo."), None);
        assert_eq!(stated_sql("Here:\n```\nSELECT * FROM t\n```"), Some("SELECT * FROM t"));
        assert_eq!(single_value("[(2,)]"), Some("2"));
        assert_eq!(single_value("[(None,)]"), None);
        assert_eq!(single_value("[('a',), ('b',)]"), None);
    }
}
