//! The Python value model DBBench's observations and grading are defined in.
//!
//! AgentBench shows query results to the agent as Python's `str(list_of_tuples)` and
//! grades read answers after `str()`/`eval()` round trips. To agree with it byte for
//! byte, results are converted into [`PyValue`]s and printed with Python's `repr`/`str`
//! rules ([`PyValue::repr`], [`float_repr`], [`str_repr`]), and answer strings that look
//! like Python lists are read back with [`parse_literal`] (the literal subset of
//! `eval`: lists, tuples, strings, numbers, `None`, `True`, `False`; any other name fails
//! as `eval` would with a `NameError`).

use std::fmt::Write as _;

/// A Python value as far as DBBench needs one.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    /// An `int`, as its decimal digits (optional leading `-`).
    Int(String),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<PyValue>),
    Tuple(Vec<PyValue>),
    Dict(Vec<(PyValue, PyValue)>),
    /// Any other object (`Decimal`, `datetime.date`, ...), with its `repr` and `str`.
    Object {
        repr: String,
        str: String,
    },
}

impl PyValue {
    /// Python's `repr(value)`.
    pub fn repr(&self) -> String {
        let mut out = String::new();
        self.write_repr(&mut out);
        out
    }

    /// Appends Python's `repr(value)` to `out`.
    pub fn write_repr(&self, out: &mut String) {
        match self {
            PyValue::None => out.push_str("None"),
            PyValue::Bool(true) => out.push_str("True"),
            PyValue::Bool(false) => out.push_str("False"),
            PyValue::Int(digits) => out.push_str(digits),
            PyValue::Float(f) => out.push_str(&float_repr(*f)),
            PyValue::Str(s) => out.push_str(&str_repr(s)),
            PyValue::Bytes(b) => out.push_str(&bytes_repr(b)),
            PyValue::List(items) => {
                out.push('[');
                write_items(items, out);
                out.push(']');
            }
            PyValue::Tuple(items) => {
                out.push('(');
                write_items(items, out);
                if items.len() == 1 {
                    out.push(',');
                }
                out.push(')');
            }
            PyValue::Dict(pairs) => {
                out.push('{');
                for (i, (k, v)) in pairs.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    k.write_repr(out);
                    out.push_str(": ");
                    v.write_repr(out);
                }
                out.push('}');
            }
            PyValue::Object { repr, .. } => out.push_str(repr),
        }
    }

    /// Python's `str(value)`.
    pub fn to_py_str(&self) -> String {
        match self {
            PyValue::Str(s) => s.clone(),
            PyValue::Object { str, .. } => str.clone(),
            other => other.repr(),
        }
    }

    /// The value `json.loads` gives for a JSON value.
    pub fn from_json(value: &serde_json::Value) -> PyValue {
        match value {
            serde_json::Value::Null => PyValue::None,
            serde_json::Value::Bool(b) => PyValue::Bool(*b),
            serde_json::Value::Number(n) => {
                if n.is_i64() || n.is_u64() {
                    PyValue::Int(n.to_string())
                } else {
                    PyValue::Float(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            serde_json::Value::String(s) => PyValue::Str(s.clone()),
            serde_json::Value::Array(items) => PyValue::List(items.iter().map(PyValue::from_json).collect()),
            serde_json::Value::Object(map) => {
                PyValue::Dict(map.iter().map(|(k, v)| (PyValue::Str(k.clone()), PyValue::from_json(v))).collect())
            }
        }
    }
}

fn write_items(items: &[PyValue], out: &mut String) {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        item.write_repr(out);
    }
}

/// Python's `repr(float)`: the shortest round-trip digits, fixed notation when the
/// decimal exponent is in (-4, 16], scientific (`1e+16`, `1.5e-05`) otherwise.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` prints the same shortest round-trip digits Python uses.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if f < 0.0 { "-" } else { "" };
    // Python's `decpt`: value = 0.DIGITS × 10^decpt.
    let decpt = exp + 1;
    if decpt > -4 && decpt <= 16 {
        let mut out = String::from(sign);
        if decpt <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-decpt) as usize));
            out.push_str(&digits);
        } else {
            let decpt = decpt as usize;
            if digits.len() <= decpt {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', decpt - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..decpt]);
                out.push('.');
                out.push_str(&digits[decpt..]);
            }
        }
        out
    } else {
        let mut out = String::from(sign);
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
        out
    }
}

/// Whether Python's `str.isprintable` holds for a non-ASCII character. Covers the
/// categories Python escapes (Cc, Cf, Zs other than space, Zl, Zp, Co, noncharacters);
/// unassigned code points are not known here and print as themselves.
fn is_printable(c: char) -> bool {
    let u = c as u32;
    !matches!(u,
        0x80..=0x9f | 0xa0 | 0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x1680 | 0x180e
        | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064 | 0x2066..=0x206f | 0x3000
        | 0xe000..=0xf8ff | 0xfdd0..=0xfdef | 0xfeff | 0xfff9..=0xfffb | 0x110bd
        | 0x1d173..=0x1d17a | 0xe0001 | 0xe0020..=0xe007f | 0xf0000..=0x10ffff)
        && (u & 0xfffe) != 0xfffe
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`.
pub fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x7f || is_printable(c) => out.push(c),
            c if (c as u32) <= 0xff => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) <= 0xffff => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
    out
}

/// Python's `repr(bytes)`.
pub fn bytes_repr(b: &[u8]) -> String {
    let quote = if b.contains(&b'\'') && !b.contains(&b'"') { b'"' } else { b'\'' };
    let mut out = String::with_capacity(b.len() + 3);
    out.push('b');
    out.push(quote as char);
    for &c in b {
        match c {
            b'\\' => out.push_str("\\\\"),
            b'\t' => out.push_str("\\t"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c as char);
            }
            0x20..=0x7e => out.push(c as char),
            c => {
                let _ = write!(out, "\\x{c:02x}");
            }
        }
    }
    out.push(quote as char);
    out
}

/// Python's whitespace for `str.strip()` (Unicode White_Space plus the ASCII
/// information separators U+001C..U+001F that Python also strips).
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `s.strip()`.
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// Python's `float(s)` for a string: surrounding whitespace, a sign, `_` between digits,
/// `inf`/`infinity`/`nan` in any case.
pub fn py_float(s: &str) -> Option<f64> {
    let t = py_strip(s);
    let (sign, body) = match t.as_bytes().first() {
        Some(b'-') => (-1.0, &t[1..]),
        Some(b'+') => (1.0, &t[1..]),
        _ => (1.0, t),
    };
    let lower = body.to_ascii_lowercase();
    if lower == "inf" || lower == "infinity" {
        return Some(sign * f64::INFINITY);
    }
    if lower == "nan" {
        return Some(f64::NAN);
    }
    // digits ['.' digits] [e [sign] digits], at least one mantissa digit; `_` only
    // between two digits.
    let bytes = body.as_bytes();
    let mut i = 0;
    let mut clean = String::with_capacity(body.len());
    let mut mantissa_digits = 0;
    let digit_run = |i: &mut usize, clean: &mut String| -> Option<usize> {
        let start = *i;
        while *i < bytes.len() {
            let c = bytes[*i];
            if c.is_ascii_digit() {
                clean.push(c as char);
                *i += 1;
            } else if c == b'_' && *i > start && bytes[*i - 1].is_ascii_digit() && bytes.get(*i + 1).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            } else {
                break;
            }
        }
        Some(bytes[start..*i].iter().filter(|c| c.is_ascii_digit()).count())
    };
    mantissa_digits += digit_run(&mut i, &mut clean)?;
    if bytes.get(i) == Some(&b'.') {
        clean.push('.');
        i += 1;
        mantissa_digits += digit_run(&mut i, &mut clean)?;
    }
    if mantissa_digits == 0 {
        return None;
    }
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        clean.push('e');
        i += 1;
        if let Some(&s @ (b'+' | b'-')) = bytes.get(i) {
            clean.push(s as char);
            i += 1;
        }
        if digit_run(&mut i, &mut clean)? == 0 {
            return None;
        }
    }
    if i != bytes.len() {
        return None;
    }
    clean.parse::<f64>().ok().map(|v| sign * v)
}

/// Reads a Python literal the way `eval` would for the literal subset: lists, tuples,
/// (adjacent) strings with prefixes and escapes, ints, floats, `None`, `True`, `False`,
/// unary signs. `None` when `eval` would raise (unknown name, bad syntax).
pub fn parse_literal(text: &str) -> Option<PyValue> {
    let mut p = Parser { s: text.as_bytes(), text, i: 0 };
    // `eval` ignores leading spaces and tabs and surrounding newlines.
    p.skip_ws();
    let value = p.expr()?;
    p.skip_ws();
    (p.i == p.s.len()).then_some(value)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while let Some(&c) = self.s.get(self.i) {
            if matches!(c, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c') {
                self.i += 1;
            } else if c == b'\\' && matches!(self.s.get(self.i + 1), Some(b'\n')) {
                self.i += 2;
            } else {
                break;
            }
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn expr(&mut self) -> Option<PyValue> {
        self.skip_ws();
        match self.peek()? {
            b'[' => {
                self.i += 1;
                let (items, _) = self.items(b']')?;
                Some(PyValue::List(items))
            }
            b'(' => {
                self.i += 1;
                let (mut items, trailing_comma) = self.items(b')')?;
                if items.len() == 1 && !trailing_comma {
                    items.pop()
                } else {
                    Some(PyValue::Tuple(items))
                }
            }
            b'-' | b'+' => {
                let neg = self.peek() == Some(b'-');
                self.i += 1;
                match self.expr()? {
                    PyValue::Int(d) => Some(PyValue::Int(negate_int(&d, neg))),
                    PyValue::Float(f) => Some(PyValue::Float(if neg { -f } else { f })),
                    PyValue::Bool(b) => Some(PyValue::Int(negate_int(if b { "1" } else { "0" }, neg))),
                    _ => None,
                }
            }
            b'0'..=b'9' | b'.' => self.number(),
            b'\'' | b'"' => self.strings(),
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = self.i;
                while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_') {
                    self.i += 1;
                }
                let word = &self.text[start..self.i];
                if matches!(self.peek(), Some(b'\'' | b'"')) && word.len() <= 2 && word.chars().all(|c| "rRbBuU".contains(c)) {
                    self.i = start;
                    return self.strings();
                }
                match word {
                    "None" => Some(PyValue::None),
                    "True" => Some(PyValue::Bool(true)),
                    "False" => Some(PyValue::Bool(false)),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// Comma-separated items up to `close`; also says whether a trailing comma was seen.
    fn items(&mut self, close: u8) -> Option<(Vec<PyValue>, bool)> {
        let mut items = Vec::new();
        let mut trailing = false;
        loop {
            self.skip_ws();
            if self.peek()? == close {
                self.i += 1;
                return Some((items, trailing));
            }
            if !items.is_empty() && !trailing {
                return None;
            }
            items.push(self.expr()?);
            self.skip_ws();
            trailing = false;
            if self.peek()? == b',' {
                self.i += 1;
                trailing = true;
            }
        }
    }

    fn number(&mut self) -> Option<PyValue> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.') {
            let c = self.peek()?;
            self.i += 1;
            if (c == b'e' || c == b'E') && matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
        }
        let tok = &self.text[start..self.i];
        if tok.bytes().all(|c| c.is_ascii_digit() || c == b'_') {
            let digits: String = tok.chars().filter(|c| *c != '_').collect();
            // Python 3 rejects `012` but accepts `00`; `_` only between digits.
            if tok.starts_with('_') || tok.ends_with('_') || tok.contains("__") {
                return None;
            }
            if digits.len() > 1 && digits.starts_with('0') && digits.bytes().any(|c| c != b'0') {
                return None;
            }
            let trimmed = digits.trim_start_matches('0');
            return Some(PyValue::Int(if trimmed.is_empty() { "0".into() } else { trimmed.into() }));
        }
        py_float(tok).filter(|_| !tok.contains(['i', 'n', 'I', 'N'])).map(PyValue::Float)
    }

    /// One or more adjacent string literals (Python concatenates them).
    fn strings(&mut self) -> Option<PyValue> {
        let mut text = String::new();
        let mut bytes: Option<Vec<u8>> = None;
        let mut count = 0;
        loop {
            self.skip_ws();
            let start = self.i;
            while self.peek().is_some_and(|c| b"rRbBuU".contains(&c)) {
                self.i += 1;
            }
            let prefix = self.text[start..self.i].to_ascii_lowercase();
            let Some(q @ (b'\'' | b'"')) = self.peek() else {
                self.i = start;
                break;
            };
            let raw = prefix.contains('r');
            let is_bytes = prefix.contains('b');
            if count > 0 && is_bytes != bytes.is_some() {
                return None;
            }
            let triple = self.s.get(self.i..self.i + 3) == Some(&[q, q, q][..]);
            self.i += if triple { 3 } else { 1 };
            let mut lit = String::new();
            loop {
                let c = self.text[self.i..].chars().next()?;
                if triple {
                    if self.s.get(self.i..self.i + 3) == Some(&[q, q, q][..]) {
                        self.i += 3;
                        break;
                    }
                } else if c as u32 == q as u32 {
                    self.i += 1;
                    break;
                } else if c == '\n' {
                    return None;
                }
                if c == '\\' {
                    let next = self.text[self.i + 1..].chars().next()?;
                    if raw {
                        lit.push('\\');
                        lit.push(next);
                        self.i += 1 + next.len_utf8();
                        continue;
                    }
                    self.i += 1;
                    self.escape(&mut lit)?;
                    continue;
                }
                lit.push(c);
                self.i += c.len_utf8();
            }
            if is_bytes {
                if !lit.is_ascii() && !raw {
                    // Non-ASCII characters are a syntax error in bytes literals.
                    return None;
                }
                bytes.get_or_insert_with(Vec::new).extend(lit.chars().map(|c| c as u32 as u8));
            } else {
                text.push_str(&lit);
            }
            count += 1;
        }
        if count == 0 {
            return None;
        }
        Some(match bytes {
            Some(b) => PyValue::Bytes(b),
            None => PyValue::Str(text),
        })
    }

    /// After a backslash: Python's string escapes; unknown ones keep the backslash.
    fn escape(&mut self, out: &mut String) -> Option<()> {
        let c = self.text[self.i..].chars().next()?;
        self.i += c.len_utf8();
        let hex = |p: &mut Self, n: usize| -> Option<char> {
            let h = p.text.get(p.i..p.i + n)?;
            let v = u32::from_str_radix(h, 16).ok()?;
            p.i += n;
            char::from_u32(v)
        };
        match c {
            '\n' => {}
            '\\' => out.push('\\'),
            '\'' => out.push('\''),
            '"' => out.push('"'),
            'a' => out.push('\x07'),
            'b' => out.push('\x08'),
            'f' => out.push('\x0c'),
            'n' => out.push('\n'),
            'r' => out.push('\r'),
            't' => out.push('\t'),
            'v' => out.push('\x0b'),
            'x' => out.push(hex(self, 2)?),
            'u' => out.push(hex(self, 4)?),
            'U' => out.push(hex(self, 8)?),
            '0'..='7' => {
                let mut v = c.to_digit(8)?;
                for _ in 0..2 {
                    match self.peek() {
                        Some(d @ b'0'..=b'7') => {
                            v = v * 8 + (d - b'0') as u32;
                            self.i += 1;
                        }
                        _ => break,
                    }
                }
                out.push(char::from_u32(v)?);
            }
            other => {
                out.push('\\');
                out.push(other);
            }
        }
        Some(())
    }
}

fn negate_int(digits: &str, neg: bool) -> String {
    match (neg, digits.strip_prefix('-')) {
        (false, _) => digits.to_string(),
        (true, Some(pos)) => pos.to_string(),
        (true, None) if digits == "0" => "0".to_string(),
        (true, None) => format!("-{digits}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (2011.0, "2011.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (-3.25, "-3.25"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (31.666666666666668, "31.666666666666668"),
            (1e300, "1e+300"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (f64::INFINITY, "inf"),
            (f64::NAN, "nan"),
            (123456789.125, "123456789.125"),
        ] {
            assert_eq!(float_repr(f), want, "repr of {f:e}");
        }
    }

    #[test]
    fn str_repr_matches_python() {
        assert_eq!(str_repr("abc"), "'abc'");
        assert_eq!(str_repr("Checco D'Angelo"), "\"Checco D'Angelo\"");
        assert_eq!(str_repr("a'b\"c"), "'a\\'b\"c'");
        assert_eq!(str_repr("tab\there\n"), "'tab\\there\\n'");
        assert_eq!(str_repr("back\\slash"), "'back\\\\slash'");
        assert_eq!(str_repr("1–0 café"), "'1–0 café'");
        assert_eq!(str_repr("nb\u{a0}sp\u{200b}"), "'nb\\xa0sp\\u200b'");
        assert_eq!(str_repr("\u{1}"), "'\\x01'");
        assert_eq!(bytes_repr(b"a'\x00"), "b\"a'\\x00\"");
    }

    #[test]
    fn containers_print_like_python() {
        let rows = PyValue::List(vec![
            PyValue::Tuple(vec![PyValue::Str("x".into())]),
            PyValue::Tuple(vec![PyValue::Int("17".into()), PyValue::None, PyValue::Float(2.0)]),
        ]);
        assert_eq!(rows.repr(), "[('x',), (17, None, 2.0)]");
        assert_eq!(PyValue::Tuple(vec![]).repr(), "()");
        assert_eq!(
            PyValue::from_json(&serde_json::json!([1, 1.0, "a", null, true, {"k": [2]}])).repr(),
            "[1, 1.0, 'a', None, True, {'k': [2]}]"
        );
    }

    #[test]
    fn py_float_accepts_what_python_accepts() {
        assert_eq!(py_float(" 1.5 "), Some(1.5));
        assert_eq!(py_float("1_000"), Some(1000.0));
        assert_eq!(py_float("-.5"), Some(-0.5));
        assert_eq!(py_float("1."), Some(1.0));
        assert_eq!(py_float("1e3"), Some(1000.0));
        assert_eq!(py_float("Infinity"), Some(f64::INFINITY));
        assert!(py_float("NaN").unwrap().is_nan());
        for bad in ["", ".", "1_", "_1", "1__0", "1e", "1,000", "abc", "0x10", "1.2.3", "--1"] {
            assert_eq!(py_float(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn literals_parse_like_eval() {
        assert_eq!(
            parse_literal("[('09aa8fbf72f39362970f95a1276b957c',)]"),
            Some(PyValue::List(vec![PyValue::Tuple(vec![PyValue::Str("09aa8fbf72f39362970f95a1276b957c".into())])]))
        );
        assert_eq!(
            parse_literal("['a', \"b\", 3, -2.5, None, (1), (2,), ()]"),
            Some(PyValue::List(vec![
                PyValue::Str("a".into()),
                PyValue::Str("b".into()),
                PyValue::Int("3".into()),
                PyValue::Float(-2.5),
                PyValue::None,
                PyValue::Int("1".into()),
                PyValue::Tuple(vec![PyValue::Int("2".into())]),
                PyValue::Tuple(vec![]),
            ]))
        );
        assert_eq!(parse_literal("['it\\'s' 'x']"), Some(PyValue::List(vec![PyValue::Str("it'sx".into())])));
        assert_eq!(parse_literal("[1_000, 1e3]"), Some(PyValue::List(vec![PyValue::Int("1000".into()), PyValue::Float(1000.0)])));
        // eval raises on these: a bare name, a leading-zero int, a missing comma.
        assert_eq!(parse_literal("[abc]"), None);
        assert_eq!(parse_literal("[012]"), None);
        assert_eq!(parse_literal("[1 2]"), None);
        assert_eq!(parse_literal("[Decimal('1.5')]"), None);
        assert_eq!(parse_literal("[nan]"), None);
    }
}
