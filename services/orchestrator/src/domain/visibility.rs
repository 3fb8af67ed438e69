//! Who sees a run or a thread: the principal it belongs to, or every caller when authentication
//! is off (the anonymous principal). Another principal's run or thread is as unknown to a caller
//! as one that does not exist. Approvers see more when they decide: `approval::Decider`.

use shared::auth::Principal;

/// Whether `caller` may see what `owner` owns.
pub fn sees(caller: &Principal, owner: &str) -> bool {
    caller.is_anonymous() || caller.name == owner
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(name: &str) -> Principal {
        Principal::unrestricted(name)
    }

    #[test]
    fn a_caller_sees_its_own_and_the_anonymous_caller_sees_everything() {
        assert!(sees(&principal("alice"), "alice"));
        assert!(!sees(&principal("alice"), "bob"));
        assert!(sees(&Principal::anonymous(), "bob"));
        assert!(!sees(&principal(""), "bob"), "an empty name is no one, not everyone");
    }
}
