//! An answer computed on a task of its own for a caller that may stop waiting for it.
//!
//! A claim is written by a task, not in its caller's future: a caller cancelled while the statement ran
//! (a client gone, a deadline) would otherwise leave a claim nobody heard of, in progress until its lease
//! ran out. Both such tasks (a lone claim, a shared statement) answer through a oneshot channel, and the
//! caller's end is this guard: whatever the sender could not deliver, it undoes itself; whatever it had
//! delivered just before the caller left, the guard undoes. Either way, once.

use tokio::sync::oneshot;

/// The caller's end of an answer that must not be lost. Dropped before the answer was taken, it closes
/// the channel (the sender's `send` fails from then on, and the sender undoes what it sent for nobody),
/// and hands an answer that had already arrived to `unheard`.
pub(crate) struct Awaiting<T, U: FnOnce(T)> {
    pub(crate) answer: oneshot::Receiver<T>,
    unheard: Option<U>,
}

impl<T, U: FnOnce(T)> Awaiting<T, U> {
    pub(crate) fn new(answer: oneshot::Receiver<T>, unheard: U) -> Self {
        Self { answer, unheard: Some(unheard) }
    }
}

impl<T, U: FnOnce(T)> Drop for Awaiting<T, U> {
    fn drop(&mut self) {
        self.answer.close();
        if let (Ok(answer), Some(unheard)) = (self.answer.try_recv(), self.unheard.take()) {
            unheard(answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// An answer sent but not taken is handed to `unheard`; one taken is not; after the drop the sender
    /// learns that nobody hears.
    #[test]
    fn an_answer_nobody_took_is_undone_once() {
        let undone = Cell::new(0);
        let (reply, answer) = oneshot::channel();
        reply.send(7).expect("open");
        drop(Awaiting::new(answer, |n: i32| undone.set(undone.get() + n)));
        assert_eq!(undone.get(), 7);

        let (reply, answer) = oneshot::channel::<i32>();
        let mut awaiting = Awaiting::new(answer, |n: i32| undone.set(undone.get() + n));
        reply.send(1).expect("open");
        assert_eq!(awaiting.answer.try_recv(), Ok(1));
        drop(awaiting);
        assert_eq!(undone.get(), 7, "a taken answer is the caller's");

        let (reply, answer) = oneshot::channel::<i32>();
        drop(Awaiting::new(answer, |n: i32| undone.set(undone.get() + n)));
        assert_eq!(reply.send(2), Err(2), "the sender hears that nobody waits");
        assert_eq!(undone.get(), 7);
    }
}
