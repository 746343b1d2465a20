//! `schemas/projection.sql` documents what is on disk; it must stay the migrations' text, in order.

#[test]
fn schemas_projection_sql_is_the_migration() {
    let documented = include_str!("../../../schemas/projection.sql");
    let migrations = [
        include_str!("../migrations/0001_projection.sql"),
        include_str!("../migrations/0002_quarantine.sql"),
        include_str!("../migrations/0003_placement.sql"),
    ]
    .concat();
    assert_eq!(
        documented, migrations,
        "concatenate shared/store/migrations/*.sql (in order) into schemas/projection.sql"
    );
}
