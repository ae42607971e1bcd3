//! RFC 6901 JSON pointers: the fields a fingerprint leaves out, or the only ones it compares.

use std::borrow::Cow;

use super::json::Canon;
use crate::error::InputError;

/// A pointer, split into unescaped reference tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JsonPointer(Vec<String>);

impl JsonPointer {
    pub(crate) fn parse(pointer: &str) -> Result<Self, InputError> {
        let Some(rest) = pointer.strip_prefix('/') else {
            return Err(InputError::InvalidPointer { pointer: pointer.to_owned() });
        };
        let tokens = rest.split('/').map(|t| t.replace("~1", "/").replace("~0", "~")).collect();
        Ok(Self(tokens))
    }

    /// The value the pointer names, if there is one.
    pub(super) fn find<'c, 'a>(&self, root: &'c Canon<'a>) -> Option<&'c Canon<'a>> {
        self.0.iter().try_fold(root, |node, token| match node {
            Canon::Object(members) => member(members, token).map(|i| &members[i].1),
            Canon::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get(i)),
            _ => None,
        })
    }

    /// Removes the member (or blanks the array element, to keep later indices stable) that the
    /// pointer names; a pointer to nothing changes nothing.
    pub(super) fn blank(&self, root: &mut Canon) {
        let Some((last, parents)) = self.0.split_last() else { return };
        let mut node = root;
        for token in parents {
            let next = match node {
                Canon::Object(members) => member(members, token).map(|i| &mut members[i].1),
                Canon::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
                _ => None,
            };
            match next {
                Some(child) => node = child,
                None => return,
            }
        }
        match node {
            Canon::Object(members) => {
                if let Some(i) = member(members, last) {
                    members.remove(i);
                }
            }
            Canon::Array(items) => {
                if let Some(item) = last.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                    *item = Canon::Null;
                }
            }
            _ => {}
        }
    }

    /// The tokens as a JSON array of strings (unambiguous, unlike the pointer's own spelling).
    pub(super) fn write_tokens(&self, out: &mut Vec<u8>) {
        out.push(b'[');
        for (i, token) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            super::write_string(token, out);
        }
        out.push(b']');
    }
}

/// The index of the member `name` in a sorted object.
fn member(members: &[(Cow<'_, str>, Canon<'_>)], name: &str) -> Option<usize> {
    members.binary_search_by(|(candidate, _)| candidate.as_ref().cmp(name)).ok()
}
