//! A strict JSON parser (RFC 8259) that keeps every number as its text, so fingerprints never pass a
//! number through `f64` and never depend on how `serde_json` is built (its `arbitrary_precision` feature,
//! enabled by any crate in a build, changes what its parser hands out). Bounded in depth; objects that
//! repeat a member are refused, since two parsers may disagree about which copy counts.

use std::borrow::Cow;

use crate::error::InputError;

/// A parsed JSON value, borrowing its strings and numbers from the body where no escape forced a copy.
/// Objects keep their members sorted by name (byte order).
#[derive(Debug, PartialEq)]
pub(super) enum Canon<'a> {
    Null,
    Bool(bool),
    /// The number's text as written (valid JSON number syntax).
    Number(&'a str),
    String(Cow<'a, str>),
    Array(Vec<Canon<'a>>),
    Object(Vec<(Cow<'a, str>, Canon<'a>)>),
}

/// Parses `body` as exactly one JSON value, nesting arrays and objects at most `max_depth` deep.
pub(super) fn parse(body: &[u8], max_depth: usize) -> Result<Canon<'_>, InputError> {
    let mut parser = Parser { body, at: 0, depth: 0, max_depth };
    let value = parser.value()?;
    parser.whitespace();
    if parser.at != body.len() {
        return Err(parser.invalid("trailing characters"));
    }
    Ok(value)
}

struct Parser<'a> {
    body: &'a [u8],
    at: usize,
    depth: usize,
    max_depth: usize,
}

impl<'a> Parser<'a> {
    fn value(&mut self) -> Result<Canon<'a>, InputError> {
        self.whitespace();
        match self.peek() {
            Some(b'{') => self.nested(Self::object),
            Some(b'[') => self.nested(Self::array),
            Some(b'"') => Ok(Canon::String(self.string()?)),
            Some(b't') => self.literal("true", Canon::Bool(true)),
            Some(b'f') => self.literal("false", Canon::Bool(false)),
            Some(b'n') => self.literal("null", Canon::Null),
            Some(b'-' | b'0'..=b'9') => self.number().map(Canon::Number),
            Some(_) => Err(self.invalid("expected a value")),
            None => Err(self.invalid("unexpected end of input")),
        }
    }

    fn nested(&mut self, parse: fn(&mut Self) -> Result<Canon<'a>, InputError>) -> Result<Canon<'a>, InputError> {
        if self.depth >= self.max_depth {
            return Err(InputError::TooDeep { limit: self.max_depth });
        }
        self.depth += 1;
        self.at += 1;
        let value = parse(self);
        self.depth -= 1;
        value
    }

    fn array(&mut self) -> Result<Canon<'a>, InputError> {
        let mut items = Vec::new();
        self.whitespace();
        if self.eat(b']') {
            return Ok(Canon::Array(items));
        }
        loop {
            items.push(self.value()?);
            self.whitespace();
            if self.eat(b']') {
                return Ok(Canon::Array(items));
            }
            self.expect(b',')?;
        }
    }

    fn object(&mut self) -> Result<Canon<'a>, InputError> {
        let mut members = Vec::new();
        self.whitespace();
        if !self.eat(b'}') {
            loop {
                self.whitespace();
                if self.peek() != Some(b'"') {
                    return Err(self.invalid("expected a member name"));
                }
                let name = self.string()?;
                self.whitespace();
                self.expect(b':')?;
                members.push((name, self.value()?));
                self.whitespace();
                if self.eat(b'}') {
                    break;
                }
                self.expect(b',')?;
            }
        }
        // Byte order, as `str` compares; a repeated name ends up next to itself.
        members.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let Some(pair) = members.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(InputError::DuplicateMember { name: pair[0].0.clone().into_owned() });
        }
        Ok(Canon::Object(members))
    }

    /// A string starting at the opening quote: borrowed when it holds no escape.
    fn string(&mut self) -> Result<Cow<'a, str>, InputError> {
        self.at += 1;
        let start = self.at;
        let mut copied: Option<Vec<u8>> = None;
        let mut run = start;
        loop {
            match self.peek() {
                None => return Err(self.invalid("unterminated string")),
                Some(b'"') => {
                    let text = match copied {
                        None => Cow::Borrowed(self.utf8(&self.body[start..self.at])?),
                        Some(mut bytes) => {
                            bytes.extend_from_slice(&self.body[run..self.at]);
                            Cow::Owned(String::from_utf8(bytes).map_err(|_| self.invalid("invalid UTF-8"))?)
                        }
                    };
                    self.at += 1;
                    return Ok(text);
                }
                Some(b'\\') => {
                    let bytes = copied.get_or_insert_with(Vec::new);
                    bytes.extend_from_slice(&self.body[run..self.at]);
                    self.at += 1;
                    bytes.extend_from_slice(self.escape()?.encode_utf8(&mut [0; 4]).as_bytes());
                    run = self.at;
                }
                Some(0..0x20) => return Err(self.invalid("control character in a string")),
                Some(_) => self.at += 1,
            }
        }
    }

    /// The character of an escape, after its backslash.
    fn escape(&mut self) -> Result<char, InputError> {
        let Some(letter) = self.peek() else { return Err(self.invalid("unterminated escape")) };
        self.at += 1;
        Ok(match letter {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let unit = self.hex4()?;
                let code = match unit {
                    0xD800..=0xDBFF => {
                        if !(self.eat(b'\\') && self.eat(b'u')) {
                            return Err(self.invalid("lone leading surrogate"));
                        }
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(self.invalid("lone leading surrogate"));
                        }
                        0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00)
                    }
                    0xDC00..=0xDFFF => return Err(self.invalid("lone trailing surrogate")),
                    _ => u32::from(unit),
                };
                char::from_u32(code).ok_or_else(|| self.invalid("invalid escape"))?
            }
            _ => return Err(self.invalid("invalid escape")),
        })
    }

    fn hex4(&mut self) -> Result<u16, InputError> {
        let digits = self.body.get(self.at..self.at + 4).ok_or_else(|| self.invalid("short \\u escape"))?;
        let text = std::str::from_utf8(digits).map_err(|_| self.invalid("invalid \\u escape"))?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(self.invalid("invalid \\u escape"));
        }
        self.at += 4;
        u16::from_str_radix(text, 16).map_err(|_| self.invalid("invalid \\u escape"))
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, as written.
    fn number(&mut self) -> Result<&'a str, InputError> {
        let start = self.at;
        self.eat(b'-');
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.invalid("invalid number")),
        }
        if self.eat(b'.') {
            self.required_digits()?;
        }
        if self.eat(b'e') || self.eat(b'E') {
            if !self.eat(b'+') {
                self.eat(b'-');
            }
            self.required_digits()?;
        }
        // Only ASCII was consumed.
        self.utf8(&self.body[start..self.at])
    }

    fn required_digits(&mut self) -> Result<(), InputError> {
        if !self.peek().is_some_and(|b| b.is_ascii_digit()) {
            return Err(self.invalid("invalid number"));
        }
        self.digits();
        Ok(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &str, value: Canon<'a>) -> Result<Canon<'a>, InputError> {
        if !self.body[self.at..].starts_with(word.as_bytes()) {
            return Err(self.invalid("expected a value"));
        }
        self.at += word.len();
        Ok(value)
    }

    fn whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.body.get(self.at).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        self.at += usize::from(found);
        found
    }

    fn expect(&mut self, byte: u8) -> Result<(), InputError> {
        if self.eat(byte) { Ok(()) } else { Err(self.invalid("unexpected character")) }
    }

    fn utf8(&self, bytes: &'a [u8]) -> Result<&'a str, InputError> {
        std::str::from_utf8(bytes).map_err(|_| self.invalid("invalid UTF-8"))
    }

    fn invalid(&self, what: &str) -> InputError {
        InputError::InvalidJson(serde::de::Error::custom(format_args!("{what} at byte {}", self.at)))
    }
}
