//! `schemas/projection.sql` documents what is on disk; it must stay the migration's text.

#[test]
fn schemas_projection_sql_is_the_migration() {
    let documented = include_str!("../../../schemas/projection.sql");
    let migration = include_str!("../migrations/0001_projection.sql");
    assert_eq!(
        documented, migration,
        "copy shared/store/migrations/0001_projection.sql to schemas/projection.sql"
    );
}
