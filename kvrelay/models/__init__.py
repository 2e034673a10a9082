"""(filled by its issue)"""
