//! A minimal Python pickle writer (protocol 2): the values a memory snapshot needs.

use std::collections::HashMap;

/// A Python value.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Value {
    Bool(bool),
    Int(i64),
    Str(String),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    /// A dict with string keys, in insertion order.
    Dict(Vec<(&'static str, Value)>),
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_string())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const BINUNICODE: u8 = b'X';
const EMPTY_LIST: u8 = b']';
const EMPTY_DICT: u8 = b'}';
const EMPTY_TUPLE: u8 = b')';
const MARK: u8 = b'(';
const APPENDS: u8 = b'e';
const SETITEMS: u8 = b'u';
const TUPLE: u8 = b't';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// Items per `APPENDS` / `SETITEMS` batch, as Python's own pickler batches them.
const BATCH: usize = 1000;

/// Strings up to this length are memoized, so repeated keys and labels are written once.
const MEMO_MAX_LEN: usize = 256;

/// `value` pickled with protocol 2.
pub(super) fn dumps(value: &Value) -> Vec<u8> {
    let mut w = Writer {
        out: vec![PROTO, 2],
        memo: HashMap::new(),
    };
    w.value(value);
    w.out.push(STOP);
    w.out
}

struct Writer {
    out: Vec<u8>,
    memo: HashMap<String, u32>,
}

impl Writer {
    fn value(&mut self, v: &Value) {
        match v {
            Value::Bool(b) => self.out.push(if *b { NEWTRUE } else { NEWFALSE }),
            Value::Int(i) => self.int(*i),
            Value::Str(s) => self.str(s),
            Value::List(items) => {
                self.out.push(EMPTY_LIST);
                for chunk in items.chunks(BATCH) {
                    self.out.push(MARK);
                    for item in chunk {
                        self.value(item);
                    }
                    self.out.push(APPENDS);
                }
            }
            Value::Tuple(items) => {
                if items.is_empty() {
                    self.out.push(EMPTY_TUPLE);
                } else {
                    self.out.push(MARK);
                    for item in items {
                        self.value(item);
                    }
                    self.out.push(TUPLE);
                }
            }
            Value::Dict(entries) => {
                self.out.push(EMPTY_DICT);
                for chunk in entries.chunks(BATCH) {
                    self.out.push(MARK);
                    for (k, v) in chunk {
                        self.str(k);
                        self.value(v);
                    }
                    self.out.push(SETITEMS);
                }
            }
        }
    }

    fn int(&mut self, i: i64) {
        if (0..=0xff).contains(&i) {
            self.out.extend([BININT1, i as u8]);
        } else if (0..=0xffff).contains(&i) {
            self.out.push(BININT2);
            self.out.extend((i as u16).to_le_bytes());
        } else if let Ok(i) = i32::try_from(i) {
            self.out.push(BININT);
            self.out.extend(i.to_le_bytes());
        } else {
            // Two's complement, little-endian, in as few bytes as keep the sign.
            let bytes = i.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let top = bytes[n - 1];
                let sign_below = bytes[n - 2] & 0x80 != 0;
                if (top == 0 && !sign_below) || (top == 0xff && sign_below) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.out.extend([LONG1, n as u8]);
            self.out.extend(&bytes[..n]);
        }
    }

    fn str(&mut self, s: &str) {
        if let Some(&i) = self.memo.get(s) {
            match u8::try_from(i) {
                Ok(i) => self.out.extend([BINGET, i]),
                Err(_) => {
                    self.out.push(LONG_BINGET);
                    self.out.extend(i.to_le_bytes());
                }
            }
            return;
        }
        self.out.push(BINUNICODE);
        self.out.extend((s.len() as u32).to_le_bytes());
        self.out.extend(s.as_bytes());
        if s.len() <= MEMO_MAX_LEN {
            let i = self.memo.len() as u32;
            match u8::try_from(i) {
                Ok(i) => self.out.extend([BINPUT, i]),
                Err(_) => {
                    self.out.push(LONG_BINPUT);
                    self.out.extend(i.to_le_bytes());
                }
            }
            self.memo.insert(s.to_string(), i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_values_match_python() {
        // What Python's pickle.dumps(v, 2) writes (less the memo entries it adds for
        // containers, which are optional).
        assert_eq!(dumps(&Value::Bool(true)), b"\x80\x02\x88.");
        assert_eq!(dumps(&Value::Int(5)), b"\x80\x02K\x05.");
        assert_eq!(dumps(&Value::Int(300)), b"\x80\x02M\x2c\x01.");
        assert_eq!(dumps(&Value::Int(-1)), b"\x80\x02J\xff\xff\xff\xff.");
        assert_eq!(dumps(&Value::List(vec![])), b"\x80\x02].");
        assert_eq!(dumps(&Value::Dict(vec![])), b"\x80\x02}.");
        // pickle.dumps(2**40, 2) == b'\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01.'
        assert_eq!(
            dumps(&Value::Int(1 << 40)),
            b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01."
        );
        // pickle.dumps(2**31, 2) needs a fifth byte for the sign.
        assert_eq!(
            dumps(&Value::Int(1 << 31)),
            b"\x80\x02\x8a\x05\x00\x00\x00\x80\x00."
        );
        assert_eq!(
            dumps(&Value::Int(-(1 << 40))),
            b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\xff."
        );
    }

    #[test]
    fn repeated_strings_are_memoized() {
        let v = Value::List(vec!["ab".into(), "ab".into()]);
        assert_eq!(dumps(&v), b"\x80\x02](X\x02\x00\x00\x00abq\x00h\x00e.");
    }
}
