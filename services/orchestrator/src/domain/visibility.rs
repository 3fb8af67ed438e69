//! Who sees a run or a thread: the principal it belongs to, or every caller when authentication
//! is off (the anonymous principal). Another principal's run or thread is as unknown to a caller
//! as one that does not exist. Operators read every run and thread they can list (`GetRun`,
//! `AttachRun`, `GetThread`) but act on none of another's; approvers, who decide any run's calls
//! (`approval::Decider`), read the runs they decide on the same way, so the run they are asked
//! about opens for them.

use shared::auth::Principal;

/// Whether `caller` may see and act on what `owner` owns.
pub fn sees(caller: &Principal, owner: &str) -> bool {
    caller.is_anonymous() || caller.name == owner
}

/// Whether `caller` may read what `owner` owns: as [`sees`], or with the operator role, which
/// lists every principal's runs and so opens them, or the approver role, which decides every
/// run's calls and so reads the runs it decides on.
pub fn reads(caller: &Principal, owner: &str) -> bool {
    sees(caller, owner) || caller.has_role(shared::auth::OPERATOR) || caller.has_role(shared::auth::APPROVER)
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
        let operator = Principal {
            roles: vec![shared::auth::OPERATOR.to_owned()],
            ..principal("olga")
        };
        assert!(
            reads(&operator, "bob") && !sees(&operator, "bob"),
            "operators read, never act"
        );
        assert!(!reads(&principal("alice"), "bob"));
        let approver = Principal {
            roles: vec![shared::auth::APPROVER.to_owned()],
            ..principal("ada")
        };
        assert!(
            reads(&approver, "bob") && !sees(&approver, "bob"),
            "approvers read what they decide on"
        );
        assert!(!sees(&principal(""), "bob"), "an empty name is no one, not everyone");
    }
}
